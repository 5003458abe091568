#!/usr/bin/env bash
# One device call: install from the carried nvidia-cutlass wheel (the GPU machine has no network), build, then the CUDA
# tests, compute-sanitizer, or the benchmark. Logs land in $OUT (default ./gpu_logs).
#   usage: benchmark/gpu_session.sh [test|sanitize|bench|decode|all] [extra bench.py args...]
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu_logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
# Wheels carried in .whl: nvidia-cutlass (needed), and pytest-xdist with execnet (optional: the tests then run in 8
# processes on the one GPU, ~40 s instead of several minutes).
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
fi
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
t0=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -e . --no-build-isolation -v > "$out/build.log" 2>&1 \
  || { grep -v "^ *$" "$out/build.log" | tail -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
grep -h "kernels built\|hdim.*: [0-9]* s" "$out/build.log" | tail -30
python3 benchmark/ptxas_report.py build/kernels > "$out/ptxas.txt"
grep -v "regs=.* stack=0 spill=0/0" "$out/ptxas.txt" || echo "ptxas: no kernel has a stack frame or spills"
if [ "$what" = test ] || [ "$what" = all ]; then
  python3 -m pytest -m cuda tests -q -x "${workers[@]}" -p no:cacheprovider 2>&1 | tee "$out/test.log" | tail -25
  # The default tier on an H100/H200 is SM90; the SM80 tier's kernels run there too, by override.
  FLASH_ATTN_TIER=sm80 python3 -m pytest -m cuda tests/test_fwd.py tests/test_bwd.py tests/test_varlen.py -q -x "${workers[@]}" \
    -p no:cacheprovider 2>&1 | tee "$out/test_sm80.log" | tail -5
fi
if [ "$what" = sanitize ]; then
  dims=$(python3 -c "from flash_attention import _dispatch; print(' '.join(sorted({str(key[2]) for key in _dispatch.available_kernels()}, key=int)))")
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 20 python3 benchmark/small_case.py $dims 2>&1 | tee "$out/sanitize_$tool.log" | tail -6
    compute-sanitizer --tool $tool --print-limit 20 python3 benchmark/small_case.py --decode $dims 2>&1 \
      | tee "$out/sanitize_decode_$tool.log" | tail -3
  done
fi
if [ "$what" = decode ]; then
  for page in 0 16 256; do
    python3 benchmark/bench.py --decode --page-size $page --json "$out/decode_page$page.json" "$@" 2>&1 \
      | tee "$out/decode_page$page.log"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmark/bench.py --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.log"
fi
