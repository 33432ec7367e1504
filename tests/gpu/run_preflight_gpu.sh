#!/bin/bash
# preflight's GPU runs (after the recipe of docs/gpu-evidence.md ("Setting up the GPU machine"): TE in /tmp/site, megatron-core 0.19.2 in
# /tmp/mc19; Megatron-LM main as a source tree of megatron/core, e.g. /tmp/mlm). Run from the project root.
#   bash tests/gpu/run_preflight_gpu.sh cases MEGATRON_DIR TAG [--fd-detail]   # every required case
#   bash tests/gpu/run_preflight_gpu.sh bench MEGATRON_DIR TAG                 # benchmarks/gpu/preflight_cost.py
#   bash tests/gpu/run_preflight_gpu.sh zoo MEGATRON_DIR TAG                   # cost, profile, zoo + bugs
#       (JITTER=K: the zoo and bugs under K seeds of the noise's jitter; ZOO_TIMEOUT to match)
#   bash tests/gpu/run_preflight_gpu.sh compare MEGATRON_DIR TAG OTHER_MG      # cost of this checkout and of
#       another maingrad install (pip install --target OTHER_MG), alternating processes, then a trace
#   bash tests/gpu/run_preflight_gpu.sh scaling MEGATRON_DIR TAG               # cost per micro-batch size and
#       micro-batches per step (GRID="1x3 4x3": sequences x micro-batches; CASES="..." other cases)
# Logs and JSON go to $OUT/TAG-*.{log,json}; each case's verdict line starts with VERDICT.
set -u
source "$(dirname "$0")/gpu_setup.sh" /tmp/mg
what=$1 mc=$2 tag=$3; shift 3
PP=$MG:/tmp/site:$mc:$(pwd)/tests/gpu/stub
TE_CASES="moe/optim_grads_params/fusion moe/no_shard/fusion moe/optim/fusion moe/optim_grads_params/nofusion
  moe-opfuser/optim_grads_params/fusion moe-opfuser/no_shard/fusion
  dense-fused/optim_grads_params/fusion dense-fused/no_shard/fusion dense-fused/optim_grads_params/nofusion
  dense-te/optim_grads_params/fusion moe/ddp/fusion moe/ddp-distopt/fusion"
GPT_CASES="gpt-local/no_shard/fusion gpt-local/optim/fusion gpt-local/optim_grads_params/fusion
  gpt-local/no_shard/nofusion gpt-local/optim_grads_params/nofusion gpt-local/ddp/fusion"
case "$what" in
  cases)
    PYTHONPATH=$PP timeout ${TE_TIMEOUT:-240} python3 tests/gpu/preflight_gpu.py --tag "$tag" \
      --json "$OUT/$tag-te.json" "$@" $TE_CASES > "$OUT/$tag-te.log" 2>&1
    echo "te rc=$?"
    PYTHONPATH=$PP timeout ${GPT_TIMEOUT:-150} python3 tests/gpu/preflight_gpu.py --tag "$tag" \
      --json "$OUT/$tag-gpt.json" $GPT_CASES > "$OUT/$tag-gpt.log" 2>&1
    echo "gpt rc=$?"
    grep -h -e '^VERDICT' -e 'megatron-core' -e 'finite differences per module type' "$OUT/$tag-te.log" "$OUT/$tag-gpt.log"
    ;;
  zoo)
    # the 541M GPT's cost first (ROUNDS interleaved rounds, passing and failing), then where a call's time goes,
    # then the model zoo and the injected bugs
    PYTHONPATH=$PP timeout ${COST_TIMEOUT:-150} python3 tests/gpu/preflight_zoo.py --cost "${ROUNDS:-10}" \
      --json "$OUT/$tag-cost.json" gpt541m-untied-ddp-bf16 bug-541m-overwrite > "$OUT/$tag-cost.log" 2>&1
    echo "cost rc=$?"
    grep -h '^COST' "$OUT/$tag-cost.log" | cut -c1-420
    PYTHONPATH=$PP timeout ${PROFILE_TIMEOUT:-90} python3 tests/gpu/preflight_profile.py \
      gpt541m-untied-ddp-bf16 > "$OUT/$tag-profile.log" 2>&1
    echo "profile rc=$?"
    grep -h '^PROFILE module_fd' "$OUT/$tag-profile.log" | cut -c1-600
    PYTHONPATH=$PP timeout ${ZOO_TIMEOUT:-200} python3 tests/gpu/preflight_zoo.py --json "$OUT/$tag-zoo.json" \
      --jitter-seeds "${JITTER:-1}" zoo bugs > "$OUT/$tag-zoo.log" 2>&1
    echo "zoo rc=$?"
    grep -h '^ZOO' "$OUT/$tag-zoo.log" | cut -c1-160
    ;;
  compare)
    # the 541M GPT's cost (CASES: other cases) with this checkout (new) and another install (old), ROUNDS rounds per process,
    # PAIRS times alternately on the same machine (ORDER="old new" runs the other install first in each pair);
    # then where this checkout's call waits (preflight_trace.py; TRACE=0 skips it)
    other=$1
    for r in $(seq "${PAIRS:-2}"); do
      for v in ${ORDER:-new old}; do
        m=$MG; [ "$v" = old ] && m=$other
        PYTHONPATH=$m:/tmp/site:$mc:$(pwd)/tests/gpu/stub timeout ${COST_TIMEOUT:-100} python3 tests/gpu/preflight_zoo.py \
          --cost "${ROUNDS:-6}" --json "$OUT/$tag-cost-$v-$r.json" ${CASES:-gpt541m-untied-ddp-bf16 bug-541m-overwrite} \
          > "$OUT/$tag-cost-$v-$r.log" 2>&1
        echo "$v $r rc=$?"
        grep -h '^COST' "$OUT/$tag-cost-$v-$r.log" | cut -c1-330
      done
    done
    if [ "${TRACE:-1}" != 0 ]; then
      (cd tests/gpu && PYTHONPATH=$PP:. timeout ${TRACE_TIMEOUT:-80} python3 preflight_trace.py gpt541m-untied-ddp-bf16 \
        "$OUT/$tag-trace.json.gz" > "$OUT/$tag-trace.log" 2>&1)
      echo "trace rc=$?"
      grep -h -e '^TRACE.* step ' -e 'TRACE preflight preflight' -e 'evaluate' -e 'Check.single' "$OUT/$tag-trace.log"
    fi
    # a call brings back a few files only: one archive
    (cd "$OUT" && tar czf "$tag-compare.tgz" "$tag"-cost-* $(ls "$tag"-trace.* 2>/dev/null) && rm -f "$tag"-cost-* "$tag"-trace.*)
    ;;
  scaling)
    # the 541M GPT's cost (ROUNDS interleaved rounds, passing and failing) per "sequences x micro-batches" of
    # GRID: how the ratio moves from a step bound by the host's launching (1 sequence of 2048 tokens per
    # micro-batch) to one bound by the device, and with the micro-batches per step (CASES: other cases)
    for g in ${GRID:-1x3 2x3 4x3 1x6}; do
      b=${g%x*} n=${g#*x}
      PYTHONPATH=$PP timeout ${COST_TIMEOUT:-150} python3 tests/gpu/preflight_zoo.py --cost "${ROUNDS:-8}" \
        --batch "$b" --microbatches "$n" --json "$OUT/$tag-scaling-$g.json" \
        ${CASES:-gpt541m-untied-ddp-bf16 bug-541m-overwrite} > "$OUT/$tag-scaling-$g.log" 2>&1
      echo "$g rc=$?"
      grep -h '^COST' "$OUT/$tag-scaling-$g.log" | cut -c1-330
    done
    (cd "$OUT" && tar czf "$tag-scaling.tgz" "$tag"-scaling-* && rm -f "$tag"-scaling-*.json "$tag"-scaling-*.log)
    ;;
  bench)
    PYTHONPATH=$PP timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/gpu/preflight_cost.py > "$OUT/$tag-bench.log" 2>&1
    echo "bench rc=$?"
    grep -e '^RESULT' -e '^OPTIMIZER' -e '^BASELINE' -e '^MEMORY' -e '^TRACE' -e 'megatron-core' "$OUT/$tag-bench.log"
    ;;
esac
