#!/usr/bin/env bash
# A second drafter trained on the hidden states a run has already extracted, beside the run's
# own training: one GPU node holds both (a small drafter's training leaves most of a GPU idle),
# so two training settings are compared on the same data without extracting it twice or
# needing the disk twice.
#
#   bash benchmarks/train_beside.sh WORKDIR CONFIG... ARM_OVERLAY
#
# CONFIG... are the run's config files and ARM_OVERLAY (last) what this drafter changes, only
# train settings. WORKDIR (made) gets links to this checkout's resources/ and to the run's data
# stages (results/<run>/ data, regenerated, prepared, hidden, consolidated); Snakemake, started
# there on this checkout's Snakefile, finds every data output in place and makes only
# train_drafter and export_drafter: WORKDIR/results/<run>/{train,export}, its logs in
# WORKDIR/logs/<run>/. The run's files are only read; its hidden directory gains the marker
# every linked hidden directory gets (.eaglenest-hidden-states, eaglenest/plan.py).
# A plan with any other job (an overlay that changes the data) is refused
# before anything runs. Waits for READY first (default logs/h200/DATA_DONE, which
# benchmarks/run.sh writes after its data phase) at most WAIT_S (3600) seconds.
# Knobs: RUN_ROOT (the run's working directory, default this checkout), CORES (8), TARGET (below), SNAKEMAKE (as benchmarks/h200_steps.sh picks it), DRY_RUN=1 (the plan only).
# Writes WORKDIR/beside.log (each step) and WORKDIR/DONE with the exit status.
source "$(dirname "$0")/h200_steps.sh"
WORKDIR="${1:?usage: bash benchmarks/train_beside.sh WORKDIR CONFIG... ARM_OVERLAY}"
shift
[ $# -ge 2 ] || { echo "name the run's config files and the arm's overlay" >&2; exit 2; }
for f in "$@"; do [ -f "$f" ] || { echo "no config file $f" >&2; exit 2; }; done
mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
rm -f "$WORKDIR/DONE"
note() { echo "$(stamp) $*" | tee -a "$WORKDIR/beside.log" >&2; }
finish() { echo "$1" >"$WORKDIR/DONE"; note "done rc=$1"; exit "$1"; }
CONFIGS=()
for f in "$@"; do case $f in /*) CONFIGS+=("$f") ;; *) CONFIGS+=("$REPO/$f") ;; esac; done
RUN=$(setting - run "${CONFIGS[@]}")
[ -n "$RUN" ] || { note "no run: in the config files"; finish 2; }
READY="${READY:-logs/h200/DATA_DONE}"
if [ "${DRY_RUN:-0}" != 1 ] && ! wait_for "$READY" "${WAIT_S:-3600}"; then
  note "no $READY after ${WAIT_S:-3600} s: the run's data phase did not finish"
  finish 1
fi
ROOT=$(cd "${RUN_ROOT:-$REPO}" && pwd)
mkdir -p "$WORKDIR/results/$RUN"
[ -e "$ROOT/resources" ] && ln -sfn "$ROOT/resources" "$WORKDIR/resources"
for stage in data regenerated prepared hidden consolidated; do
  [ -e "$ROOT/results/$RUN/$stage" ] && ln -sfn "$ROOT/results/$RUN/$stage" "$WORKDIR/results/$RUN/$stage"
done
# TARGET: benchmarks/train_arms.sh names the export's report, as its SNAKEMAKE allows some rules
# only and cannot build the default target that --until starts from
read -r -a TARGET <<<"${TARGET:---until export_drafter}"
SM=($SNAKEMAKE --snakefile "$REPO/Snakefile" --directory "$WORKDIR" --rerun-triggers=mtime
  --cores "${CORES:-8}" "${TARGET[@]}" --configfile "${CONFIGS[@]}")
planned=$("${SM[@]}" -n --quiet rules 2>&1 | awk 'NF == 2 && $2 ~ /^[0-9]+$/ && $1 != "total" && $1 != "job" {print $1}' | sort -u | tr '\n' ' ')
note "planned: $planned"
for rule in $planned; do
  case $rule in
  train_drafter | export_drafter) ;;
  *) note "refused: the plan would make $rule (the arm's overlay must change train settings only)"; finish 2 ;;
  esac
done
[[ " $planned " == *" train_drafter "* ]] || { note "refused: nothing to train (is results/$RUN/consolidated/ there?)"; finish 2; }
[ "${DRY_RUN:-0}" = 1 ] && finish 0
note "training: $*"
"${SM[@]}" >"$WORKDIR/train.log" 2>&1
finish $?
