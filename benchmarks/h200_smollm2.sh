#!/usr/bin/env bash
# The real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU):
# the full set, and the three 1K-conversation arms (original / regenerated / bf16 states)
# beside it on the same GPU. Writes logs/h200/*.log, times.tsv and logs/h200/DONE.
#   bash benchmarks/h200_smollm2.sh [extra config files...]
# The arms run in their own working directory on a RAM disk (ARMS_DIR): a second
# Snakemake in this directory would be refused its lock, and the full set's 52 GB of fp8
# states keep the local disk to themselves.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
SNAKEMAKE=${SNAKEMAKE:-snakemake}
ARMS_DIR=${ARMS_DIR:-/dev/shm/eaglenest-arms}
EXTRA=("$@")
mkdir -p logs/h200 "$ARMS_DIR/results"
rm -f logs/h200/DONE

stamp() { date -u +%FT%TZ; }
timed() {  # name, command...: wall seconds and exit status into logs/h200/times.tsv
  local name=$1 start=$SECONDS rc
  shift
  echo "$(stamp) start $name" >>"$REPO/logs/h200/progress.log"
  "$@" >"$REPO/logs/h200/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$rc" >>"$REPO/logs/h200/times.tsv"
  echo "$(stamp) end $name rc=$rc" >>"$REPO/logs/h200/progress.log"
  return $rc
}

# The converted target is shared by every run: make it once, before they start.
timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile config/h200-smollm2.yaml "${EXTRA[@]}"

# The arms' working directory: the workflow's files linked, results of its own.
for entry in Snakefile rules scripts config envs report profiles eaglenest resources; do
  ln -sfn "$REPO/$entry" "$ARMS_DIR/$entry"
done
for run in h200-1k-original h200-1k-regenerated h200-1k-bf16; do
  [ -d "results/$run/data" ] && mkdir -p "$ARMS_DIR/results/$run" && cp -a "results/$run/data" "$ARMS_DIR/results/$run/"
done
SUBSET=(config/h200-smollm2.yaml config/h200/subset-1k.yaml)
arms() {
  cd "$ARMS_DIR" || return 1
  timed arm-regenerated $SNAKEMAKE --cores 6 --configfile "${SUBSET[@]}" config/h200/regenerated.yaml "${EXTRA[@]}"
  timed arm-original $SNAKEMAKE --cores 6 --configfile "${SUBSET[@]}" "${EXTRA[@]}"
  timed arm-bf16 $SNAKEMAKE --cores 6 --configfile "${SUBSET[@]}" config/h200/bf16.yaml "${EXTRA[@]}"
}
arms &
timed full $SNAKEMAKE --cores 10 --configfile config/h200-smollm2.yaml "${EXTRA[@]}"
wait
touch logs/h200/DONE
