#!/usr/bin/env bash
# The fifth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU):
#   1. the training step's throughput at this run's shape (SmolLM2 drafter, 8 rows of 4,096),
#      beside prepare and the greedy references on the CPU cores; it sizes the epochs;
#   2. the data half (extraction of the full set, consolidation), then training for as many
#      epochs as TRAIN_BUDGET_S holds, export, and replay of every drafting setting on every
#      prompt (config/h200-smollm2.yaml + carried-data.yaml + run5.yaml);
#   3. benchmarks/sglang_h200.sh beside the training: real SGLang with the extraction plugin,
#      and the drafter in $DRAFTER_EXPORT served with EAGLE-3 (it waits for $DRAFTER_EXPORT/READY).
#   bash benchmarks/h200_run5.sh    (writes logs/h200/: progress.log, times.tsv, one log per
#                                    step, bench/*.json, sglang/, and DONE at the end)
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations), the SGLang wheel archives in $SGLANG_WHEELS.
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-540}  # wall seconds the training may take
EPOCHS=${EPOCHS:-}                      # empty: sized from the measured throughput
TOKENS_PER_EPOCH=21185028               # the full set's training tokens (run 4's summary)
SGLANG_WHEELS=${SGLANG_WHEELS:-.sglang-wheels}
DRAFTER_EXPORT=${DRAFTER_EXPORT:-}
SGLANG_DELAY_S=${SGLANG_DELAY_S:-45}    # start SGLang once the training holds its memory
BENCH=logs/h200/bench
mkdir -p logs/h200 $BENCH
rm -f logs/h200/DONE

timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${CONFIGS[@]}" || exit 1

# --- CPU: prepare and the references; GPU: the step's throughput, then extraction -----------
timed data $SNAKEMAKE --cores 15 --keep-going --configfile "${CONFIGS[@]}" --until consolidate evaluate_reference &
DATA=$!
timed bench-train timeout 200 python3 benchmarks/train_throughput.py --shape smollm2 --rows 8 --token-budget 4096 \
  --sample-len 2048 --steps 10 --warmup 3 --out "$BENCH/train_throughput_h200_smollm2_run5.json"
wait $DATA || { echo "$(stamp) data half failed" >>logs/h200/progress.log; exit 1; }

if [ -z "$EPOCHS" ]; then
  # The benchmark's step is the training's step without data loading, validation and
  # checkpoints, beside nothing: count 70 % of its tokens/s.
  EPOCHS=$(python3 - "$TRAIN_BUDGET_S" "$TOKENS_PER_EPOCH" <<'PY'
import json, sys
runs = json.load(open("logs/h200/bench/train_throughput_h200_smollm2_run5.json"))["runs"]
tps = next(r["tokens_per_s"] for r in runs if "tokens_per_s" in r and "step" not in r)
print(max(2, min(10, int(float(sys.argv[1]) * tps * 0.7 / float(sys.argv[2])))))
PY
  ) || EPOCHS=2
fi
echo "$(stamp) epochs: $EPOCHS" >>logs/h200/progress.log
printf 'train:\n  epochs: %s\n' "$EPOCHS" >logs/h200/epochs.yaml

timed pipeline $SNAKEMAKE --cores 15 --configfile "${CONFIGS[@]}" logs/h200/epochs.yaml &
PIPELINE=$!

if [ "${SGLANG:-1}" = 1 ] && [ -n "$DRAFTER_EXPORT" ]; then
  (
    sleep "$SGLANG_DELAY_S"
    for _ in $(seq 1 60); do [ -f "$DRAFTER_EXPORT/READY" ] && break; sleep 5; done
    shard=$(ls results/h200-smollm2/prepared/*/shard-00000.safetensors | head -1)
    SITE=${SGLANG_SITE:-/tmp/sglang-site} SGLANG_WHEELS=$SGLANG_WHEELS TARGET_DIR=resources/models/SmolLM2-135M-Instruct \
      PREPARED_SHARD=$shard DRAFTER_EXPORT=$DRAFTER_EXPORT EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl \
      MEM_FRACTION=0.25 TIME_LIMIT_S=${SGLANG_LIMIT_S:-600} timed sglang bash benchmarks/sglang_h200.sh logs/h200/sglang
  ) &
fi

wait
touch logs/h200/DONE
