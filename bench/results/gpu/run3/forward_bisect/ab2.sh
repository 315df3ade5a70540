set -u
root=$PWD
for v in D E F; do
  (cd /tmp && PYTHONPATH=$root/.gpu/old/$v:$root/bench:$PYTHONPATH timeout 60 python3 $root/bench/gpu_step.py --forward-only --no-torch --out $OUT/fwd_$v.json 2>&1 | grep -E "forward_only|Error" | tail -2 | sed "s/^/$v: /")
done
