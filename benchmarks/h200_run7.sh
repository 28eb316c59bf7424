#!/usr/bin/env bash
# The seventh real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): run 5's
# data, split, draft vocabulary, references and shape (8 rows of 4,096 tokens), trained with the
# one-pass loss (eaglenest/stages/draft_loss.py) for as many epochs as fit $TRAIN_S seconds of steps.
#   1. convert the GGUF; then, while prepare and extract run (the data phase, --until consolidate):
#      the training step's benchmark at the real shape (draft vocabulary 32,000, fp8 rows), then
#      bf16 noise over the first prepared shard (transformers in bfloat16 against itself in
#      float32, on the GPU).
#   2. the epochs: TRAIN_S / (STEPS_PER_EPOCH x the benchmark's step seconds), rounded, 1 to 5.
#   3. the whole workflow at those epochs: training, the greedy references and the replay on
#      the CPU cores, the export.
#   4. once the drafter is trained, on the otherwise idle GPU: the step with the code before
#      the one-pass loss ($OLD_CODE: that commit's eaglenest/, benchmarks/train_throughput.py
#      and config/schema.yaml, e.g. `git archive 7249e9c eaglenest benchmarks/train_throughput.py
#      config/schema.yaml | tar -x -C .bench-old`) and with this checkout's, one after the
#      other; a profile of the step's operators; the step with train.compile.
#   OLD_CODE=.bench-old TRAIN_S=780 bash benchmarks/h200_run7.sh   (logs/h200/: progress.log,
#                                    times.tsv, one log per step, bench/*.json, DONE at the end)
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations).
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
TRAIN_S=${TRAIN_S:-780}
STEPS_PER_EPOCH=${STEPS_PER_EPOCH:-770}  # run 6: 2,310 steps for 3 epochs of this data and shape
CORES=${CORES:-14}
OLD_CODE=${OLD_CODE:-}
RUN_DIR=results/h200-smollm2
BENCH=logs/h200/bench
SHAPE=(--shape smollm2 --rows 8 --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000
  --threads 2)
mkdir -p logs/h200 $BENCH
rm -f logs/h200/DONE
# The benchmarks' random shards and drafters stay off the disk, which holds the run's 50 GB.
export TMPDIR=/dev/shm

timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${CONFIGS[@]}" || exit 1
timed data $SNAKEMAKE --cores "$CORES" --configfile "${CONFIGS[@]}" --until consolidate &
DATA=$!

timed bench-step timeout 240 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --steps 9 --warmup 3 \
  --out $BENCH/train_throughput_h200_smollm2_v32k.json
shard=$(ls $RUN_DIR/prepared/*/shard-00000.safetensors 2>/dev/null | head -1)
if [ -n "$shard" ]; then
  timed noise-gpu timeout 300 python3 benchmarks/sglang_h200.py noise --prepared "$shard" \
    --target-dir resources/models/SmolLM2-135M-Instruct --rows 914982,622441,583244 --samples 887 --device cuda \
    --threads 2 --tokens-per-batch 65536 --out $BENCH/bf16_noise_transformers_h200.json &
fi

wait $DATA || exit 1
step_s=$(python3 - "$BENCH/train_throughput_h200_smollm2_v32k.json" <<'EOF'
import json, statistics, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
    print(statistics.median(runs[0]["step_seconds"][3:]))
except Exception:
    print(0.45)  # the sixth run's real step
EOF
)
epochs=$(python3 -c "print(max(1, min(5, round($TRAIN_S / ($STEPS_PER_EPOCH * $step_s)))))")
printf 'train:\n  epochs: %s\n  val_every: 150\n' "$epochs" >logs/h200/epochs.yaml
echo "$(stamp) step ${step_s}s -> epochs: $epochs" >>logs/h200/progress.log

timed pipeline $SNAKEMAKE --cores "$CORES" --keep-going --configfile "${CONFIGS[@]}" logs/h200/epochs.yaml &
PIPELINE=$!
# The replay jobs come before the export in Snakemake's order: wait for the trained drafter.
if wait_for "$RUN_DIR/train/drafter/config.json" 2400; then
  # The step before and after the one-pass loss, one after the other on the same idle GPU.
  if [ -n "$OLD_CODE" ]; then
    timed bench-step-before timeout 200 python3 "$OLD_CODE/benchmarks/train_throughput.py" "${SHAPE[@]}" --steps 7 \
      --warmup 2 --out $BENCH/train_throughput_h200_smollm2_v32k_before.json
  fi
  timed bench-step-after timeout 200 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --steps 7 --warmup 2 \
    --out $BENCH/train_throughput_h200_smollm2_v32k_after2.json
  timed bench-profile timeout 200 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --profile --steps 7 --warmup 2 \
    --out $BENCH/train_throughput_h200_smollm2_v32k_profile.json
  timed bench-compile timeout 300 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --compile --ceiling --steps 9 \
    --warmup 4 --out $BENCH/train_throughput_h200_smollm2_v32k_compile.json
fi
wait $PIPELINE
touch logs/h200/DONE
