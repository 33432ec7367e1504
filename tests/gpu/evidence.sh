#!/bin/bash
# GPU evidence runs of the evidence issue that are not the hooks' own (those are in run_hooks_gpu.sh).
# Needs the recipe of docs/gpu-evidence.md ("Setting up the GPU machine") done (TE in /tmp/site, megatron-core in /tmp/mc18, /tmp/mc19)
# and the service's wheels carried in .whl/ (see docs/gpu-evidence.md).
#   bash tests/gpu/evidence.sh fix        # run 1: `maingrad fix` on 0.18.2, then train the fixed sources
#   bash tests/gpu/evidence.sh service    # run 3: hooks' HTTP sink -> maingrad serve on loopback -> gate
#   bash tests/gpu/evidence.sh overhead   # run 4: hooks' share of a 64-expert MoE step (CUDA events);
#                                         # TAG names the log (overhead-$TAG.log)
#   bash tests/gpu/evidence.sh dense      # MG001's 0.19.2 findings: TEFusedMLPWithGroupedLinear and
#                                         # FusedSharedExpertMLP under Megatron-FSDP as shipped and with hooks
#   bash tests/gpu/evidence.sh dense-fixed  # the same two classes after `maingrad fix` on their sources
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MG=/tmp/mg SVC=/tmp/svc
[ -d /tmp/site/transformer_engine ] || { echo "TE is not installed in /tmp/site: run the recipe first"; exit 3; }
if [ ! -d $MG/maingrad/analyzer ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target $MG . > "$OUT/pip-mg.log" 2>&1 \
    || tail -5 "$OUT/pip-mg.log"
fi
if [ -d .whl ] && [ ! -d $SVC/fastapi ]; then
  ls -R .whl | grep -c "whl$" | sed "s/^/service wheels: /"
  python3 -m pip install -q --no-deps --no-index --no-compile --target $SVC $(find .whl -type f -name "*.whl") > "$OUT/pip-svc.log" 2>&1 \
    || tail -5 "$OUT/pip-svc.log"
fi
EXPERTS_PY=megatron/core/transformer/moe/experts.py  # not EXPERTS: moe_overhead.py reads that
maingrad() { PYTHONPATH=$MG:$SVC python3 -m maingrad.cli "$@"; }
hooks_run() {  # hooks_run NAME MEGATRON_DIR ARGS...
  local name=$1 mc=$2; shift 2
  echo "### $name: $*"
  PYTHONPATH=$MG:/tmp/site:$mc timeout 240 python3 tests/gpu/mcore_hooks.py --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  sed -n '/^maingrad hooks on/,$p' "$OUT/$name.log" | grep -v -e Warning -e 'warnings.warn' -e 'return func' -e ProcessGroupNCCL
}
fixed_tree() {
  if [ ! -d /tmp/mc18fix ]; then
    cp -r /tmp/mc18 /tmp/mc18fix
    maingrad fix /tmp/mc18fix/$EXPERTS_PY > "$OUT/fix.log" 2>&1
    local rc=$?
    echo "maingrad fix rc=$rc ($(tail -1 "$OUT/fix.log"))"
    [ $rc = 0 ] || { rm -rf /tmp/mc18fix; echo "maingrad fix failed: no fixed tree"; exit 4; }
  fi
}
case "${1:-fix}" in
  fix)
    fixed_tree
    diff -u /tmp/mc18/$EXPERTS_PY /tmp/mc18fix/$EXPERTS_PY > "$OUT/experts-fix.diff"
    echo "diff: $(grep -c '^+[^+]' "$OUT/experts-fix.diff") lines added, $(grep -c '^-[^-]' "$OUT/experts-fix.diff") removed"
    maingrad check /tmp/mc18fix/$EXPERTS_PY --select MG001 --no-cache; echo "check MG001 on the fixed file: rc=$?"
    for s in optim_grads_params no_shard; do
      hooks_run fixed-$s-mb2 /tmp/mc18fix --cases fused nonfused plain --strategy $s --mb 2 --no-sync
    done
    ;;
  service)
    fixed_tree
    export MAINGRAD_DATABASE_URL=sqlite:////tmp/mg-evidence.db MAINGRAD_SECRET=gpu-evidence
    rm -f /tmp/mg-evidence.db*
    TOKEN=$(maingrad token create --project gpu --scope upload --scope read 2>/dev/null | tail -1)
    setsid nohup env PYTHONPATH=$MG:$SVC python3 -m maingrad.cli serve --port 8765 --no-access-log \
      > "$OUT/serve.log" 2>&1 < /dev/null &
    for _ in $(seq 1 60); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8765/healthz')" 2>/dev/null && break; sleep 0.5; done
    URL=http://127.0.0.1:8765
    R="--url $URL --project gpu --token $TOKEN"
    maingrad check /tmp/mc18 --format json --no-cache > "$OUT/report-mc18.json"
    maingrad check /tmp/mc18fix --format json --no-cache > "$OUT/report-mc18fix.json"
    maingrad upload "$OUT/report-mc18.json" $R --commit c18unfixed --branch main
    maingrad upload "$OUT/report-mc18fix.json" $R --commit c18fixed --branch main
    maingrad upload "$OUT/report-mc18fix.json" $R --commit c18fixed-ogp --branch main
    H="--cases hooks --mode observe --no-sync --mb 2 --http $URL --project gpu --token $TOKEN"
    # c18unfixed: 0.18.2 as shipped, hooks observing only -> TE raises MAIN GRAD NOT FOUND; the records say why.
    hooks_run svc-unfixed /tmp/mc18 $H --strategy optim_grads_params --commit c18unfixed --run unfixed
    # c18fixed: the statically fixed sources, no_shard (overwrite_main_grad never set) -> trains, records clean.
    hooks_run svc-fixed /tmp/mc18fix $H --strategy no_shard --commit c18fixed --run fixed
    # c18fixed-ogp: the same sources under optim_grads_params at data-parallel size 1, where Megatron-FSDP sets
    # overwrite_main_grad=True on an unsharded buffer -> micro-batch 0's expert gradients are overwritten
    # (docs/gpu-evidence.md); no static rule sees that, the runtime records do.
    hooks_run svc-fixed-ogp /tmp/mc18fix $H --strategy optim_grads_params --commit c18fixed-ogp --run fixed-ogp
    echo "### gate c18unfixed"; maingrad gate $R --commit c18unfixed; echo "rc=$?"
    echo "### gate c18fixed (baseline c18unfixed)"; maingrad gate $R --commit c18fixed --base c18unfixed; echo "rc=$?"
    echo "### gate c18fixed-ogp (baseline c18unfixed)"
    maingrad gate $R --commit c18fixed-ogp --base c18unfixed | grep -v '^  \(fixed\|new\|unchanged\) '
    echo "rc=${PIPESTATUS[0]}"
    maingrad gate $R --commit c18unfixed --format json > "$OUT/gate-c18unfixed.json"
    for c in c18fixed c18fixed-ogp; do
      maingrad gate $R --commit $c --base c18unfixed --format json > "$OUT/gate-$c.json"
    done
    python3 - "$URL" "$TOKEN" <<'PY' | tee "$OUT/runs.txt"
import json, sys, urllib.request
url, token = sys.argv[1:3]
req = urllib.request.Request(f"{url}/api/v1/projects/gpu/runs?limit=20", headers={"Authorization": f"Bearer {token}"})
try:
    runs = json.load(urllib.request.urlopen(req))["items"]
except Exception as exc:  # noqa: BLE001
    runs = []
    print("runs: error", exc)
for run in runs:
    print(json.dumps(run)[:700])
PY
    ;;
  dense)
    D="--mlp dense-grouped --mb 2" S="--mlp shared-grouped --mb 2"
    hooks_run dense-ogp-mb2 /tmp/mc19 $D --strategy optim_grads_params
    hooks_run dense-optim-mb2 /tmp/mc19 $D --strategy optim --no-sync --cases fused hooks nonfused plain
    hooks_run shared-ogp-mb2 /tmp/mc19 $S --strategy optim_grads_params --no-sync --cases fused hooks check nonfused plain
    ;;
  dense-fixed)
    # FIXED holds the two files after `maingrad fix` on the CPU machine (libcst is not on the device):
    #   cp $MC19/megatron/core/{extensions/transformer_engine.py,transformer/moe/shared_experts.py} .gpu/mc19fix/
    #   maingrad fix .gpu/mc19fix/    # then carry .gpu/mc19fix
    FIXED=${FIXED:-.gpu/mc19fix}
    D="--mlp dense-grouped --mb 2 --per-param" S="--mlp shared-grouped --mb 2"
    rm -rf /tmp/mc19fix && cp -r /tmp/mc19 /tmp/mc19fix
    cp $FIXED/transformer_engine.py /tmp/mc19fix/megatron/core/extensions/transformer_engine.py
    cp $FIXED/shared_experts.py /tmp/mc19fix/megatron/core/transformer/moe/shared_experts.py
    for f in megatron/core/extensions/transformer_engine.py megatron/core/transformer/moe/shared_experts.py; do
      b=$(basename $f .py)
      diff -u /tmp/mc19/$f /tmp/mc19fix/$f > "$OUT/$b-fix.diff"
      echo "$b: $(grep -c '^+[^+]' "$OUT/$b-fix.diff") lines added, $(grep -c '^-[^-]' "$OUT/$b-fix.diff") removed"
    done
    hooks_run dense-fixed-ogp-mb2 /tmp/mc19fix $D --strategy optim_grads_params --no-sync --cases fused nonfused plain
    hooks_run dense-fixed-noshard-mb2 /tmp/mc19fix $D --strategy no_shard --no-sync --cases fused nonfused plain
    hooks_run dense-fixed-noshard-mb1 /tmp/mc19fix $D --strategy no_shard --mb 1 --no-sync --cases fused nonfused plain
    hooks_run shared-fixed-ogp-mb2 /tmp/mc19fix $S --strategy optim_grads_params --no-sync --cases fused nonfused plain
    ;;
  overhead)
    NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 PYTHONPATH=$MG:/tmp/site:/tmp/mc19 timeout 400 python3 benchmarks/gpu/moe_overhead.py \
      2>&1 | tee "$OUT/overhead${TAG:+-$TAG}.log" | grep -v -e Warning -e warnings.warn -e ProcessGroupNCCL | tail -40
    ;;
esac
