"""sok_keras: sharded embedding tables for Keras 3 (TensorFlow backend)."""

from sok_keras._version import __version__
