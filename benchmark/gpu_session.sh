#!/usr/bin/env bash
# One device call: install from the carried nvidia-cutlass wheel (the GPU machine has no network), build, run the CUDA
# tests, then the benchmark. Logs land in $OUT (default ./gpu_logs).
#   usage: benchmark/gpu_session.sh [test|bench|all] [extra bench.py args...]
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu_logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl || exit 1
fi
t0=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -e . --no-build-isolation -v > "$out/build.log" 2>&1 \
  || { grep -v "^ *$" "$out/build.log" | tail -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
grep -h "kernels built\|hdim.*: [0-9]* s" "$out/build.log" | tail -15
grep -h "Compiling entry\|registers\|spill" build/kernels/*.log | paste - - - | \
  sed -E 's/.*fwd_kernelINS0_9FwdTraitsIL?i?([^E]*)E.*for .(sm_[0-9a]+).*\t *([0-9]+ bytes stack frame, [0-9]+ bytes spill stores).*Used ([0-9]+) registers.*/\1 \2 \3 regs=\4/' \
  | sort -u > "$out/ptxas.txt"
cat "$out/ptxas.txt"
if [ "$what" = test ] || [ "$what" = all ]; then
  python3 -m pytest -m cuda tests -q -x -p no:cacheprovider 2>&1 | tee "$out/test.log" | tail -25
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmark/bench.py --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.log"
fi
