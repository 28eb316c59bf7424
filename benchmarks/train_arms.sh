#!/usr/bin/env bash
# Several drafters trained on one GPU node, on the data of one run whose answered set is already
# in place (results/<run>/regenerated/, carried from the node that regenerated it): the data phase
# once, then the run's own drafter (the control) and one more per arm overlay on the same hidden
# states: one data phase and one disk's worth of hidden states for all. The control trains first,
# then each arm after it; SIDE_BY_SIDE=1 starts the arms beside the control instead, which pays
# only where one training leaves the GPU idle: with train.compile a SmolLM2 drafter keeps an H100
# busy alone (202k tokens/s), and two side by side ran at 69k each, 395 s where one after the
# other takes about 310 s (docs/results/h100-2026-12-07-greedy-arms/).
#
#   bash benchmarks/train_arms.sh OUTDIR CONFIG... -- ARM_OVERLAY...
#
# CONFIG... are the run's config files (the control); each ARM_OVERLAY changes train settings
# only (an overlay with another section is refused) and trains in OUTDIR/arm-<overlay name>/
# (benchmarks/train_beside.sh: links to the run's data stages). Snakemake runs with --allowed-rules (the
# target's conversion, prepare, extraction and its server, consolidation, training, export), so
# what is in place is read as it is: no ingest, synthesis or regeneration is planned, and a
# missing input of the allowed jobs is an error, not a regeneration. The control trains in the
# run's directory (RUN_ROOT, default this checkout: results/<run>/train, export).
# Knobs: RUN_ROOT, CORES (the data phase's, default all), ARM_CORES (each training's Snakemake, 5),
# SNAKEMAKE (as benchmarks/h200_steps.sh picks it), SIDE_BY_SIDE=1, DRY_RUN=1 (the plans only).
# Writes OUTDIR/arms.log (each step), OUTDIR/times.tsv (name, wall seconds, exit status), one
# log per step in OUTDIR, OUTDIR/DATA_DONE after the data phase and OUTDIR/DONE with the exit
# status (0 when every drafter is exported).
source "$(dirname "$0")/h200_steps.sh"
OUT="${1:?usage: bash benchmarks/train_arms.sh OUTDIR CONFIG... -- ARM_OVERLAY...}"
shift
CONFIGS=() ARMS=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do CONFIGS+=("$1"); shift; done
[ $# -gt 0 ] && shift
ARMS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || { echo "name the run's config files" >&2; exit 2; }
for f in "${CONFIGS[@]}" "${ARMS[@]}"; do [ -f "$f" ] || { echo "no config file $f" >&2; exit 2; }; done
absolute() { for f in "$@"; do case $f in /*) echo "$f" ;; *) echo "$REPO/$f" ;; esac; done; }
mapfile -t CONFIGS < <(absolute "${CONFIGS[@]}")
mapfile -t ARMS < <(absolute "${ARMS[@]}")
ROOT=$(cd "${RUN_ROOT:-$REPO}" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/DONE" "$OUT/DATA_DONE"
note() { echo "$(stamp) $*" | tee -a "$OUT/arms.log" >&2; }
step() { # name, command...: its log in OUTDIR, its wall time and status in OUTDIR/times.tsv
  local name=$1 start=$SECONDS rc
  shift
  note "start $name"
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$rc" >>"$OUT/times.tsv"
  note "end $name rc=$rc"
  return $rc
}
# An arm is refused unless it sets train settings only: its explicit target (below) plans no data
# job, so a plan cannot show an overlay that would change the data, as train_beside.sh's does.
for arm in "${ARMS[@]}"; do
  other=$(python3 -c 'import sys, yaml; print(" ".join(sorted(set(yaml.safe_load(open(sys.argv[1])) or {}) - {"train"})))' "$arm")
  [ -z "$other" ] || { note "refused: $arm sets $other (an arm changes train settings only)"; echo 2 >"$OUT/DONE"; exit 2; }
done
RUN=$(setting - run "${CONFIGS[@]}")
ALLOWED=(convert_embedded_target prepare prepare_report sglang_server extract_hidden_states hidden_states
  consolidate train_drafter export_drafter)
SM="$SNAKEMAKE --rerun-triggers=mtime --allowed-rules ${ALLOWED[*]}"
# the run's own directory; an option after SM ends --allowed-rules' values
AT=(--snakefile "$REPO/Snakefile" --directory "$ROOT")
DRY=()
[ "${DRY_RUN:-0}" = 1 ] && DRY=(-n --quiet rules)
note "run $RUN: ${CONFIGS[*]}; arms: ${ARMS[*]:-none}"
if [ -n "$(setting target embedded "${CONFIGS[@]}")" ]; then
  step convert $SM "${AT[@]}" "${DRY[@]}" --cores 4 "$(setting target path "${CONFIGS[@]}")" --configfile "${CONFIGS[@]}" ||
    { echo 1 >"$OUT/DONE"; exit 1; }
fi
step data $SM "${AT[@]}" "${DRY[@]}" --cores "${CORES:-$(nproc)}" "results/$RUN/consolidated/index.json" --configfile "${CONFIGS[@]}" ||
  { echo 1 >"$OUT/DONE"; exit 1; }
touch "$OUT/DATA_DONE"
train_arm() { # overlay: one arm in OUTDIR/arm-<name>/
  local name
  name=$(basename "$1" .yaml)
  RUN_ROOT="$ROOT" READY="$OUT/DATA_DONE" TARGET="results/$RUN/export/export_report.json" CORES="${ARM_CORES:-5}" SNAKEMAKE="$SM" \
    step "arm-$name" bash benchmarks/train_beside.sh "$OUT/arm-$name" "${CONFIGS[@]}" "$1"
}
pids=()
if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
  for arm in "${ARMS[@]}"; do train_arm "$arm" & pids+=($!); done
fi
step control $SM "${AT[@]}" "${DRY[@]}" --cores "${ARM_CORES:-5}" "results/$RUN/export/export_report.json" --configfile "${CONFIGS[@]}"
rc=$?
if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
else
  for arm in "${ARMS[@]}"; do train_arm "$arm" || rc=1; done
fi
echo "$rc" >"$OUT/DONE"
note "done rc=$rc"
exit "$rc"
