#!/usr/bin/env bash
# Kernel variants side by side in one device call: each git revision is built in place in a tree of its own (its own
# flash_attention/_C), and a command runs in each with that tree first on PYTHONPATH. Build time and device time are
# what limit a comparison, so the trees build in parallel, restricted by the usual FLASH_ATTN_* variables.
#
#   here:        benchmark/variants.sh pack .variants main sm90-bwd-m80 ...   # git archive of each revision
#   GPU machine: benchmark/variants.sh build .variants                        # (carry .variants and .whl)
#                (nvcc jobs per tree: the cores / the trees, or VARIANT_JOBS)
#                benchmark/variants.sh run .variants 'python3 benchmark/bench.py --mode bwd --json $OUT/bwd_$VARIANT.json'
#                benchmark/variants.sh run .variants 'python3 -m pytest -m cuda tests/test_bwd.py -q -x'
#
# run: the command (one shell string, single-quoted so that each run expands $VARIANT) runs from each tree's root, so
# that tests/ and benchmark/ are that revision's, with VARIANT set to the tree's name. No tree is pip-installed: an
# editable install's import hook would take precedence over PYTHONPATH.
set -uo pipefail
what=${1:?usage: variants.sh pack DIR REV... | build DIR | run DIR 'COMMAND'}
dir=${2:?the variants folder}
shift 2

case "$what" in
pack)
  mkdir -p "$dir"
  for rev in "$@"; do
    name=$(echo "$rev" | tr '/' '_')
    git archive --format=tar -o "$dir/$name.tar" "$rev" || exit 1
    echo "$dir/$name.tar: $(git rev-parse --short "$rev")"
  done
  ;;
build)
  if ! python3 -c "import cutlass_library" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
  fi
  tars=("$dir"/*.tar)
  n=${#tars[@]}
  cores=$(nproc)
  jobs=${VARIANT_JOBS:-$(( cores / n > 0 ? cores / n : 1 ))}  # VARIANT_JOBS: when several folders build at once
  t0=$(date +%s)
  for tar in "${tars[@]}"; do
    tree="${tar%.tar}"
    mkdir -p "$tree" && tar xf "$tar" -C "$tree"
    ( cd "$tree" && MAX_JOBS=$jobs python3 setup.py build_ext --inplace > build.log 2>&1 \
        && echo "$(basename "$tree"): built" || { echo "$(basename "$tree"): BUILD FAILED"; tail -30 build.log; } ) &
  done
  wait
  echo "variants built in $(( $(date +%s) - t0 )) s, $jobs nvcc jobs each"
  ;;
run)
  status=0
  for tar in "$dir"/*.tar; do
    tree=$(cd "${tar%.tar}" && pwd)
    export VARIANT=$(basename "$tree")
    echo "=== $VARIANT"
    ( cd "$tree" && PYTHONPATH="$tree" bash -c "$1" ) || status=1
  done
  exit $status
  ;;
*)
  echo "unknown step $what: pack, build or run" >&2
  exit 2
  ;;
esac
