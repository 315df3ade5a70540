#!/usr/bin/env bash
# P5b/P11 on a machine with several GPUs (see bench/MULTIGPU.md):
#   bash bench/scaling.sh alltoall N [extra args]   # sok vs torch all-to-all, N ranks
#   bash bench/scaling.sh dlrm 1,2,...,N [extra args]  # DLRM weak scaling, 1..N ranks
# Records go to $OUT_DIR (default bench/_out): alltoall_N.json,
# dlrm_scaling_1-2-...-N.json. Extra args go to the script (e.g. --small,
# --sizes-mib 16,64). Expects TensorFlow importable by $PYTHON (default
# python3); on the H200 machines source .gpu/small/device_setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: bash bench/scaling.sh alltoall N | dlrm 1,2,...,N [args]}
ranks=${2:?usage: bash bench/scaling.sh alltoall N | dlrm 1,2,...,N [args]}
shift 2
py=${PYTHON:-python3}
out=${OUT_DIR:-bench/_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TF_FORCE_GPU_ALLOW_GROWTH=true PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
case $what in
  alltoall)
    timeout 580 "$py" -m sokrun -np "$ranks" --timeout 560 "$py" \
        bench/alltoall.py --out "$out/alltoall_$ranks.json" "$@" ;;
  dlrm)
    timeout 580 "$py" bench/dlrm_scaling.py --ranks "$ranks" --timeout 280 \
        --out "$out/dlrm_scaling_${ranks//,/-}.json" "$@" ;;
  *) echo "unknown benchmark '$what': alltoall or dlrm" >&2; exit 2 ;;
esac
