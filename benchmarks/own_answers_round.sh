#!/usr/bin/env bash
# The own-answers round on one GPU node, as one command: a second set of the target's answers
# regenerated through the workflow's SGLang server beside the plain server's ceiling
# (benchmarks/sglang_round.sh, regeneration only), then the drafter trained on it, warm
# (benchmarks/run.sh --carried-data --no-evaluate; evaluate it elsewhere from the export).
#
#   SGLANG_WHEELS=.sglang-wheels NODE_WHEELS=.node-wheels bash benchmarks/own_answers_round.sh OUTDIR
#
# Reads what the overlays read: the GGUF in resources/wheels/, results/<run>/data/ (ingested
# conversations, config/h200/carried-data.yaml) and the warm-start drafter (train.init_from:
# resources/drafters/h200-2026-12-04-own-answers/), which may arrive, moved into place whole,
# while regeneration runs (run.sh waits for it at most WARM_START_WAIT_S, here 1800 s).
# Knobs: REGEN_CONFIGS and TRAIN_CONFIGS (overlays, defaults below), CEILING_SWEEP (default: Python's
# own --gc-threshold beside the config's), INTERVALS (WORKFLOW_CLIENT_INTERVALS, 64), TRAIN
# (1; 0 = regeneration only), BESIDE_CONFIGS (overlays of train settings: a second drafter trained
# on the same hidden states beside the first, benchmarks/train_beside.sh, in OUTDIR/beside/).
# Writes OUTDIR/round.log, OUTDIR/REGEN_DONE after the regeneration and OUTDIR/DONE at the end
# (after the training); the regeneration's files in OUTDIR/regen/, the
# training's in logs/h200/. DRY_RUN=1 plans the regeneration and trains nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash benchmarks/own_answers_round.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT/DONE"
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/round.log" >&2; }
read -r -a REGEN <<< "${REGEN_CONFIGS:-config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/regenerated-sampled-server.yaml config/h200/regenerated-seed1.yaml}"
read -r -a TRAIN_OVERLAYS <<< "${TRAIN_CONFIGS:-config/h200/regenerated-sampled-server.yaml config/h200/regenerated-seed1.yaml config/h200/own-answers.yaml config/h200/own-answers-seed1.yaml}"
# mtime only: the overlays after the regeneration's change the regenerate rule's params, not its
# outputs. "=" keeps the option to one value, so a target may follow it.
TRAIN_SNAKEMAKE="${SNAKEMAKE:-python3 -m snakemake --rerun-triggers=mtime}"
log "regeneration: ${REGEN[*]}"
ORDER=regen SKIP=serve GC_STATS="${GC_STATS:-1}" PROFILE_STEPS="${PROFILE_STEPS:-0}" WORKFLOW_PROFILE_LATE_S=0 \
    WORKFLOW_CLIENT_INTERVALS="${INTERVALS:-64}" CEILING_SWEEP="${CEILING_SWEEP---gc-threshold 700 10 10}" \
    bash benchmarks/sglang_round.sh "$OUT" "${REGEN[@]}"
log "sglang_round.sh rc=$?"
# sglang_round.sh marks its own end with OUTDIR/DONE (its REGEN_DONE stays): DONE marks this
# whole round's, so a caller waiting on it does not take the regeneration's end for it
rm -f "$OUT/DONE"
if [ "${DRY_RUN:-0}" = 1 ]; then
    log "dry run: training (SNAKEMAKE=\"$TRAIN_SNAKEMAKE\" benchmarks/run.sh --carried-data --no-evaluate ${TRAIN_OVERLAYS[*]}) not started"
elif [ "${TRAIN:-1}" = 1 ]; then
    # the workflow's wheels, as sglang_round.sh installed them, on the training's path too
    export PYTHONPATH="${WORKFLOW_SITE:-/tmp/workflow-site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    log "training: ${TRAIN_OVERLAYS[*]}"
    if [ -n "${BESIDE_CONFIGS:-}" ]; then
        read -r -a BESIDE <<< "$BESIDE_CONFIGS"
        log "beside it: ${BESIDE[*]}"
        # waits for run.sh's data phase (logs/h200/DATA_DONE); run.sh clears the marker first
        rm -f logs/h200/DATA_DONE
        SNAKEMAKE="$TRAIN_SNAKEMAKE" bash benchmarks/train_beside.sh "$OUT/beside" \
            config/h200-smollm2.yaml config/h200/carried-data.yaml "${TRAIN_OVERLAYS[@]}" "${BESIDE[@]}" &
        beside=$!
    fi
    WARM_START_WAIT_S="${WARM_START_WAIT_S:-1800}" SNAKEMAKE="$TRAIN_SNAKEMAKE" \
        bash benchmarks/run.sh --carried-data --no-evaluate "${TRAIN_OVERLAYS[@]}"
    log "training rc=$?"
    if [ -n "${beside:-}" ]; then
        [ -e logs/h200/DATA_DONE ] || kill "$beside" 2>/dev/null  # no data phase: nothing to train on
        wait "$beside"
        log "beside rc=$?"
    fi
fi
touch "$OUT/DONE"
