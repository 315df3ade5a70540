#!/usr/bin/env bash
# On the H200 machine (see ../shared/gpu/README.md and docs/gpu.md): runs the
# GPU tests, the CPU suite with the GPU visible, the same with
# CUDA_VISIBLE_DEVICES="", the demo on 1 and 2 ranks sharing the GPU, the
# notebook, and the P5 benchmark. Logs go to $OUT (or bench/_out).
#   source .gpu/small/device_setup.sh && bash bench/run_gpu.sh [tests|multirank|bench|all]
# (tests: GPU kernels, the multi-rank suite on the shared GPU, no-GPU runs;
# multirank: the checkpoint/consistency/divergence jobs and the demo on 1
# and 2 ranks; bench: the demo and the P5 benchmark; all: everything.)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-bench/_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TF_FORCE_GPU_ALLOW_GROWTH=true PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
status=0
step() {  # step NAME CMD...: runs CMD, logs to $out/NAME.log, keeps going
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$out/summary.log"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "=== $name: exit $rc in $((SECONDS - t0)) s; $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$out/$name.log" | tail -1)" | tee -a "$out/summary.log"
}
# Pure-Python test dependencies the image lacks (carried in .gpu/extra).
if ls .gpu/extra/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/hypothesis ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/summary.log"
python3 -c "import sok_keras._ops as o; print('build', o.build_info())" 2>&1 | tail -1 | tee -a "$out/summary.log"
if [ "$what" = tests ] || [ "$what" = all ]; then
  step gpu_tests timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 \
      tests/test_gpu.py tests/test_gpu_blocks.py tests/test_ops_loading.py
  step gpu_single timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 \
      tests/test_bad_inputs.py tests/test_properties.py tests/layers/test_keras_rs.py \
      tests/test_callbacks.py tests/test_serving.py tests/layers/test_embedding_collection.py \
      tests/test_pooled_lookup_grad.py tests/optimizers/test_sparse_unique.py \
      tests/optimizers/test_wrapper.py
  step multirank_shared_gpu timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 \
      tests/test_seed_example_multirank.py tests/test_training_multirank.py \
      tests/layers/test_layers_multirank.py tests/test_lookup_multirank.py \
      tests/test_save_load_multirank.py tests/test_seed_example.py \
      tests/examples tests/test_notebooks.py
  step no_gpu env CUDA_VISIBLE_DEVICES= timeout 100 python3 -m pytest -q \
      -p no:cacheprovider -n 4 tests/test_lookup.py tests/test_notebooks.py
fi
if [ "$what" = multirank ] || [ "$what" = all ]; then
  step multirank_checks timeout 380 python3 -m pytest -q -p no:cacheprovider -n 12 \
      tests/test_checkpoint.py tests/test_consistency.py tests/test_divergence.py \
      tests/test_launch.py tests/test_comm.py tests/test_decisions_multirank.py \
      tests/test_global_views.py tests/test_bad_inputs_multirank.py tests/test_saving.py \
      tests/test_init_global.py tests/test_recipes_horovod.py tests/test_recipes_strategy.py \
      tests/test_recipes_mirrored.py tests/test_shard_reads.py tests/test_terminate.py
fi
if [ "$what" = bench ] || [ "$what" = multirank ] || [ "$what" = all ]; then
  step demo_1rank timeout 120 python3 -m sokrun -np 1 --timeout 110 python3 -m sok_keras.examples.train_dlrm
  step demo_2ranks timeout 150 python3 -m sokrun -np 2 --timeout 140 python3 -m sok_keras.examples.train_dlrm
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  step bench timeout 280 python3 bench/gpu_step.py --out "$out/gpu_step.json"
  # P5b/P11 scripts, dry runs on the one GPU (2 ranks share it: TF
  # collectives for sok, gloo for torch): see bench/MULTIGPU.md.
  step alltoall_dryrun timeout 200 python3 -m sokrun -np 2 --timeout 190 \
      python3 bench/alltoall.py --out "$out/alltoall_1gpu_2ranks.json" \
      --sizes-mib 16,64 --iters 3 --rounds 3 --warmup 1 \
      --label "H200, 2 ranks on 1 GPU: dry run"
  step dlrm_dryrun timeout 200 python3 bench/dlrm_scaling.py --ranks 1,2 \
      --small --timeout 90 --out "$out/dlrm_1gpu_small.json" \
      --label "H200, 1 GPU: dry run"
fi
exit $status
