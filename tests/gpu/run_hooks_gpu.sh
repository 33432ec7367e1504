#!/bin/bash
# The hooks' GPU runs, in two parts that each fit one device call (after the recipe in
# docs/gpu-evidence.md ("Setting up the GPU machine") has put TE in /tmp/site and megatron-core in /tmp/mc18, /tmp/mc19).
#   bash tests/gpu/run_hooks_gpu.sh a     # megatron-core 0.18.2: default cases + the overwrite question
#   bash tests/gpu/run_hooks_gpu.sh b     # megatron-core 0.19.2, then the pytest file on 0.18.2
#   bash tests/gpu/run_hooks_gpu.sh t     # the pytest file on 0.18.2, then on 0.19.2
# Logs, JSON results and JSONL records go to $OUT (default ./gpu-out).
set -u
source "$(dirname "$0")/gpu_setup.sh" /tmp/mgh
run() {  # run NAME MEGATRON_DIR ARGS...
  local name=$1 mc=$2; shift 2
  echo "### $name: $*"
  PYTHONPATH=$MG:/tmp/site:$mc timeout 240 python3 tests/gpu/mcore_hooks.py --json "$OUT/$name.json" \
    --records "$OUT/rec-$name" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  sed -n '/^maingrad hooks on/,$p' "$OUT/$name.log" | grep -v -e Warning -e 'warnings.warn' -e 'return func' -e ProcessGroupNCCL
}
case "${1:-a}" in
  a)
    run mc18-ogp-mb2 /tmp/mc18 --strategy optim_grads_params --mb 2
    run mc18-optim-mb2 /tmp/mc18 --strategy optim --mb 2 --no-sync --cases hooks nonfused plain
    run mc18-noshard-mb2 /tmp/mc18 --strategy no_shard --mb 2 --no-sync --cases hooks nonfused plain
    run mc18-optim-mb2-force /tmp/mc18 --strategy optim --mb 2 --no-sync --policy force_true --cases hooks plain
    ;;
  b)
    run mc19-ogp-mb2 /tmp/mc19 --strategy optim_grads_params --mb 2
    run mc19-optim-mb2 /tmp/mc19 --strategy optim --mb 2 --no-sync --cases shipped nonfused plain
    run mc19-noshard-mb2 /tmp/mc19 --strategy no_shard --mb 2 --no-sync --cases shipped nonfused plain
    echo "### pytest tests/gpu/test_hooks_gpu.py on megatron-core 0.18.2"
    PYTHONPATH=$MG:/tmp/site:/tmp/mc18 timeout 300 python3 -m pytest -p no:cacheprovider tests/gpu/test_hooks_gpu.py \
      -q -rA > "$OUT/pytest-mc18.log" 2>&1
    echo "rc=$?"; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed' "$OUT/pytest-mc18.log" | tail -12
    ;;
  t)
    for v in 18 19; do
      echo "### pytest tests/gpu/test_hooks_gpu.py on megatron-core 0.$v.2"
      PYTHONPATH=$MG:/tmp/site:/tmp/mc$v timeout 280 python3 -m pytest -p no:cacheprovider tests/gpu/test_hooks_gpu.py \
        -q -rA --durations=5 > "$OUT/pytest-mc$v.log" 2>&1
      echo "rc=$?"; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|s call' "$OUT/pytest-mc$v.log" | tail -16
    done
    ;;
esac
