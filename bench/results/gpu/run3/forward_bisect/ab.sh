# A/B of the forward: (A) a5b46ad python + a5b46ad .so, (B) HEAD python + a5b46ad .so, (C) HEAD
set -u
root=$PWD
mkdir -p /tmp/ab/b && cp -r sok_keras /tmp/ab/b/ && cp .gpu/old/a/sok_keras/_sok_ops*.so .gpu/old/a/sok_keras/_build_info.py /tmp/ab/b/sok_keras/
for v in A B C; do
  case $v in A) pkg=$root/.gpu/old/a;; B) pkg=/tmp/ab/b;; C) pkg=$root;; esac
  (cd /tmp && PYTHONPATH=$pkg:$root/bench:$PYTHONPATH timeout 100 python3 $root/bench/gpu_step.py --forward-only --no-torch --out $OUT/fwd_$v.json 2>&1 | grep -E "forward_only|Error|error" | tail -2 | sed "s/^/$v: /")
done
