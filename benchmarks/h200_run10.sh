#!/usr/bin/env bash
# The tenth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): the ninth
# run's drafter trained further (train.init_from: a warm start with its own warmup and cosine)
# for EPOCHS epochs on the same data, split, draft vocabulary, references and step shape, with
# train.compile and a validation every half epoch, to see where validation accuracy levels off.
# Beside the data phase (the GGUF's conversion and prepare are CPU work; extraction of a 135M
# target uses a sliver of the GPU), the Kimi-shaped step (1 x 4,096 tokens) eager beside its
# plain eager ceiling, then compiled; training starts once both are done.
#   EPOCHS=5 bash benchmarks/h200_run10.sh
#       logs/h200/: progress.log, times.tsv, one log per step, run10.yaml; the benchmark JSONs
#       in logs/h200/bench/; EXPORTED once the export is written, then DONE.
#   Evaluation runs elsewhere, on CPU cores, from the export and the greedy references of runs 8 and 9.
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations), the ninth run's export reassembled in $START.
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
START=${START:-resources/drafters/h200-2026-12-01-run9}
EPOCHS=${EPOCHS:-5}
VAL_EVERY=${VAL_EVERY:-385}  # 771 steps an epoch (runs 7 to 9)
CORES=${CORES:-14}           # two cores left to the Kimi benchmark beside the data phase
BENCH=logs/h200/bench
KIMI=(--shape kimi --rows 1 --token-budget 4096 --sample-len 4096 --steps 8 --warmup 3)
mkdir -p $BENCH
rm -f logs/h200/EXPORTED logs/h200/DONE logs/h200/KIMI_DONE
[ -f "$START/model.safetensors" ] || { echo "no warm start drafter in $START" >>logs/h200/progress.log; exit 1; }
printf 'train:\n  epochs: %s\n  val_every: %s\n  init_from: %s\n  compile: true\n' \
  "$EPOCHS" "$VAL_EVERY" "$START" >logs/h200/run10.yaml
RUN=("${CONFIGS[@]}" logs/h200/run10.yaml)

(
  export TMPDIR=/dev/shm  # its random target and shards stay off the disk the 52 GB of shards fill
  timed bench-kimi timeout 300 python3 benchmarks/train_throughput.py "${KIMI[@]}" --ceiling \
    --out $BENCH/train_throughput_h200_kimi_run10_eager.json
  timed bench-kimi-compile timeout 360 python3 benchmarks/train_throughput.py "${KIMI[@]}" --compile \
    --out $BENCH/train_throughput_h200_kimi_run10_compile.json
  touch logs/h200/KIMI_DONE
) &

timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${RUN[@]}" || exit 1
timed data $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until consolidate || exit 1
wait_for logs/h200/KIMI_DONE 420 || echo "$(stamp) the Kimi benchmark still runs; training starts" >>logs/h200/progress.log
timed train $SNAKEMAKE --cores 16 --configfile "${RUN[@]}" --until export_drafter || exit 1
touch logs/h200/EXPORTED
# What the evaluation elsewhere needs beside the export: the shards' checksums and the split.
cp results/h200-smollm2/consolidated/index.json results/h200-smollm2/consolidated/split.json logs/h200/ 2>/dev/null
wait
touch logs/h200/DONE
