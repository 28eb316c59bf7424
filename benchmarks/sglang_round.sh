#!/usr/bin/env bash
# One round of the SGLang measurements on one GPU node, most needed first:
# 1. the carried wheels installed: SGLANG_WHEELS (.sglang-wheels) into SITE (/tmp/site), the
#    servers' path only, and NODE_WHEELS (.node-wheels, envs/workflow-node-wheels.txt) into
#    WORKFLOW_SITE (/tmp/workflow-site), the workflow's path; the embedded target converted;
# 2. regeneration: benchmarks/sglang_regenerate.sh OUTDIR/regen [config files...] (the plain
#    server's ceiling, the workflow's run, the regenerated folder in parts), then
#    OUTDIR/REGEN_DONE;
# 3. the drafter served: benchmarks/sglang_serve.sh OUTDIR/serve on the converted target, once
#    DRAFTER exists (it may arrive while regeneration runs; at most DRAFTER_WAIT_S, 1800 s).
# Then OUTDIR/DONE. OUTDIR/round.log holds each step's start, end and exit status.
#
#   SGLANG_WHEELS=.sglang-wheels NODE_WHEELS=.node-wheels DRAFTER=<an SGLang export> \
#   EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl bash benchmarks/sglang_round.sh OUTDIR [config files...]
#
# DRY_RUN=1 installs and converts nothing and runs both scripts' dry runs (their plans).
# SKIP="regen" or "serve" leaves a step out; ORDER="serve regen" serves the drafter first
# (regeneration is the longer step, and a round whose device time runs out keeps the other).
# Both scripts' own knobs pass through (CEILING_*, REGENERATE_TIMEOUT_S, CONCURRENCY,
# PROFILE_STEPS, ...). SERVER_ARGS for the served drafter
# defaults to what the carried install serves with: Triton attention (its cut sglang-kernel has
# no FA3, docs/sglang.md), the PyTorch sampler (greedy decoding samples nothing), and no prefill
# CUDA graphs (captured per server in about 80 s, and used once per prompt; decoding, drafting
# and verification keep theirs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash benchmarks/sglang_round.sh OUTDIR [config files...]}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT/REGEN_DONE" "$OUT/DONE"
SITE="${SITE:-/tmp/site}"
WORKFLOW_SITE="${WORKFLOW_SITE:-/tmp/workflow-site}"
PY="${PYTHON:-python3}"
step() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/round.log" >&2; }

DRY="${DRY_RUN:-0}"
if [ "$DRY" != 1 ] && [ -d "${NODE_WHEELS:-.node-wheels}" ]; then
    IMPORT_TEST=snakemake bash envs/sglang_wheels_install.sh "${NODE_WHEELS:-.node-wheels}" "$WORKFLOW_SITE" \
        > "$OUT/workflow-install.log" 2>&1
    step "workflow wheels rc=$?"
fi
export PYTHONPATH="$WORKFLOW_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" != 1 ] && [ -z "${EAGLENEST_SGLANG_COMMAND:-}" ]; then
    bash envs/sglang_wheels_install.sh "${SGLANG_WHEELS:-.sglang-wheels}" "$SITE" > "$OUT/sglang-install.log" 2>&1
    step "sglang wheels rc=$?"
fi
export SITE SGLANG_WHEELS=/nonexistent  # installed: the scripts below skip their own install

if [ "$DRY" != 1 ]; then
    "$PY" -m snakemake --cores all --until convert_embedded_target > "$OUT/convert.log" 2>&1
    step "target converted rc=$?"
fi
regen() {
    if [[ " ${SKIP:-} " != *" regen "* ]]; then
        step "regeneration starts"
        bash benchmarks/sglang_regenerate.sh "$OUT/regen" "$@"
        step "regeneration rc=$?"
    fi
    touch "$OUT/REGEN_DONE"
}
serve() {
    [[ " ${SKIP:-} " == *" serve "* ]] && return
    [ "$DRY" = 1 ] || for _ in $(seq 1 "${DRAFTER_WAIT_S:-1800}"); do [ -e "${DRAFTER:?DRAFTER: an SGLang export}/config.json" ] && break; sleep 1; done
    step "serve starts (drafter ${DRAFTER})"
    TARGET_DIR="${TARGET_DIR:-$PWD/resources/models/SmolLM2-135M-Instruct}" \
    SERVER_ARGS="${SERVER_ARGS:---dtype bfloat16 --mem-fraction-static 0.4 --attention-backend triton --sampling-backend pytorch --disable-prefill-cuda-graph}" \
        bash benchmarks/sglang_serve.sh "$OUT/serve"
    step "serve rc=$?"
}
for part in ${ORDER:-regen serve}; do
    case $part in
    regen) regen "$@" ;;
    serve) serve ;;
    *) step "unknown part $part in ORDER (regen, serve)"; exit 2 ;;
    esac
done
touch "$OUT/DONE"
