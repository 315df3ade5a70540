"""Example models and synthetic data (the demo, tests and benchmarks use them)."""
