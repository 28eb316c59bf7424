#!/usr/bin/env bash
# The real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU):
# the full set, and the three 1K-conversation arms (original / regenerated / bf16 states)
# beside it on the same GPU. Writes logs/h200/*.log and logs/h200/DONE.
#   bash benchmarks/h200_smollm2.sh [extra config files...]
# The arms keep their results on a RAM disk (ARMS_DIR) so the full set's 52 GB of fp8
# states have the local disk to themselves.
set -u
cd "$(dirname "$0")/.."
SNAKEMAKE=${SNAKEMAKE:-snakemake}
ARMS_DIR=${ARMS_DIR:-/dev/shm/eaglenest-arms}
EXTRA=("$@")
FULL=(--configfile config/h200-smollm2.yaml "${EXTRA[@]}")
SUBSET=(config/h200-smollm2.yaml config/h200/subset-1k.yaml)
mkdir -p logs/h200 "$ARMS_DIR"
rm -f logs/h200/DONE

stamp() { date -u +%FT%TZ; }
timed() {  # name, command...: wall seconds into logs/h200/times.tsv
  local name=$1 start=$SECONDS rc
  shift
  echo "$(stamp) start $name" >>logs/h200/progress.log
  "$@" >"logs/h200/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$rc" >>logs/h200/times.tsv
  echo "$(stamp) end $name rc=$rc" >>logs/h200/progress.log
  return $rc
}

# Results of the arms live on the RAM disk; results/<run> is a link to them.
for run in h200-1k-original h200-1k-regenerated h200-1k-bf16; do
  if [ ! -L "results/$run" ]; then
    mkdir -p "$ARMS_DIR/$run" results
    [ -d "results/$run" ] && cp -a "results/$run/." "$ARMS_DIR/$run/" && rm -rf "results/$run"
    ln -s "$ARMS_DIR/$run" "results/$run"
  fi
done

# The converted target is shared by every run: make it once, before they start.
timed convert "$SNAKEMAKE" --cores 4 "${FULL[@]}" resources/models/SmolLM2-135M-Instruct

arms() {
  timed arm-regenerated "$SNAKEMAKE" --cores 6 --configfile "${SUBSET[@]}" config/h200/regenerated.yaml "${EXTRA[@]}"
  timed arm-original "$SNAKEMAKE" --cores 6 --configfile "${SUBSET[@]}" "${EXTRA[@]}"
  timed arm-bf16 "$SNAKEMAKE" --cores 6 --configfile "${SUBSET[@]}" config/h200/bf16.yaml "${EXTRA[@]}"
}
arms &
timed full "$SNAKEMAKE" --cores 10 "${FULL[@]}"
wait
touch logs/h200/DONE
