#!/usr/bin/env bash
# The real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): the full set,
# and the 1K-conversation arms (original and regenerated answers; ARMS adds "bf16") beside it
# on the same GPU. Writes logs/h200/*.log, logs/h200/times.tsv and logs/h200/DONE.
#   bash benchmarks/h200_smollm2.sh [extra config files...]
# Each arm runs in its own working directory on a RAM disk (ARMS_DIR/<arm>): a second
# Snakemake in one directory would be refused its lock, and the full set's 52 GB of fp8
# states keep the local disk to themselves.
# Prepared samples made on another machine (results/<run>/prepared/, for example on a CPU
# box while the GPU node is busy) are kept: the driver marks them up to date after the
# target's conversion, which is newer than them (PREPARED_CARRIED=1).
source "$(dirname "$0")/h200_steps.sh"
ARMS_DIR=${ARMS_DIR:-/dev/shm/eaglenest-arms}
ARMS=${ARMS-original regenerated} # ARMS= runs the full set alone
FULL_CORES=${FULL_CORES:-10}
# FULL_UNTIL=export_drafter stops the full set before evaluation (evaluate later or elsewhere)
UNTIL=()
[ -n "${FULL_UNTIL:-}" ] && UNTIL=(--until "$FULL_UNTIL")
EXTRA=("$@")
rm -f logs/h200/DONE

FULL=(config/h200-smollm2.yaml)
SUBSET=(config/h200-smollm2.yaml config/h200/subset-1k.yaml)
arm_configs() { # arm -> its config files
  case $1 in
  original) echo "${SUBSET[@]}" ;;
  regenerated) echo "${SUBSET[@]}" config/h200/regenerated.yaml ;;
  bf16) echo "${SUBSET[@]}" config/h200/bf16.yaml ;;
  *) return 1 ;;
  esac
}
arm_cores() { # regeneration runs one shard job per core; ARM_CORES overrides (regenerated answers carried in)
  [ -n "${ARM_CORES:-}" ] && echo "$ARM_CORES" && return
  case $1 in regenerated) echo 8 ;; *) echo 4 ;; esac
}

# The converted target is shared by every run: make it once, before they start.
timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${FULL[@]}" "${EXTRA[@]}" || exit 1
if [ "${PREPARED_CARRIED:-0}" = 1 ]; then
  timed touch-prepared $SNAKEMAKE --touch --until prepare --cores 1 --configfile "${FULL[@]}" "${EXTRA[@]}"
fi

run_arm() { # arm: link the workflow into the arm's directory, bring its data, run it there
  local arm=$1 dir=$ARMS_DIR/$1 run=h200-1k-$1 configs
  read -r -a configs <<<"$(arm_configs "$arm")"
  mkdir -p "$dir/results"
  for entry in Snakefile rules scripts config envs report profiles eaglenest resources; do
    ln -sfn "$REPO/$entry" "$dir/$entry"
  done
  for carried in data regenerated; do # ingested conversations, answers regenerated elsewhere
    [ -d "results/$run/$carried" ] && mkdir -p "$dir/results/$run" && cp -a "results/$run/$carried" "$dir/results/$run/"
  done
  cd "$dir" || return 1
  timed "arm-$arm" $SNAKEMAKE --cores "$(arm_cores "$arm")" --configfile "${configs[@]}" "${EXTRA[@]}"
}
for arm in $ARMS; do
  run_arm "$arm" &
done
timed full $SNAKEMAKE --cores "$FULL_CORES" --configfile "${FULL[@]}" "${EXTRA[@]}" "${UNTIL[@]}"
wait
touch logs/h200/DONE
