#!/usr/bin/env bash
# The ninth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): the eighth
# run's drafter trained further (train.init_from, a warm start with its own warmup and cosine)
# on the same data, split, draft vocabulary, references and step shape, for as many epochs as
# fit before TRAIN_END; eager or train.compile, whichever the step benchmark measured faster.
#   bash benchmarks/h200_run9.sh bench   first, alone on the GPU: the step at the run's shape,
#                                        eager (beside its plain eager ceiling) then with
#                                        train.compile (logs/h200/bench/*.json, BENCH_DONE)
#   bash benchmarks/h200_run9.sh kimi    the Kimi-shaped step (1 x 4,096), eager beside its ceiling,
#                                        then with train.compile (about 5 minutes)
#   TRAIN_END=<unix time> bash benchmarks/h200_run9.sh run
#       1. convert the GGUF (CPU, beside the benchmark); after it, prepare, extract and
#          consolidate (--until consolidate);
#       2. the mode and epochs: (TRAIN_END - now - twice the first step) / (STEPS_PER_EPOCH x the
#          faster benchmark step + the validations), rounded down, at least 1;
#       3. train and export (--until export_drafter): EXPORTED, then DONE.
#   Evaluation runs elsewhere, on CPU cores, from the export and the eighth run's references.
#   START (default the eighth run's export) names the drafter to start from; EPOCHS fixes the
#   epochs; STEP_S (with FIRST_S) skips waiting for the benchmark and plans with that step time.
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations), the eighth run's export reassembled in $START.
source "$(dirname "$0")/h200_steps.sh"
BENCH=logs/h200/bench
mkdir -p $BENCH
SHAPE=(--shape smollm2 --rows 8 --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000)

if [ "${1:-}" = bench ]; then
  rm -f logs/h200/BENCH_DONE
  timed bench-eager timeout 240 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --ceiling --steps 10 --warmup 3 \
    --out $BENCH/train_throughput_h200_smollm2_run9_eager.json
  timed bench-compile timeout 420 python3 benchmarks/train_throughput.py "${SHAPE[@]}" --compile --steps 10 --warmup 4 \
    --out $BENCH/train_throughput_h200_smollm2_run9_compile.json
  touch logs/h200/BENCH_DONE
  exit 0
fi

if [ "${1:-}" = kimi ]; then  # the Kimi-shaped step with the one-pass loss, eager beside its ceiling, then compiled
  KIMI=(--shape kimi --rows 1 --token-budget 4096 --sample-len 4096 --steps 8 --warmup 3)
  timed bench-kimi timeout 300 python3 benchmarks/train_throughput.py "${KIMI[@]}" --ceiling \
    --out $BENCH/train_throughput_h200_kimi_eager.json
  timed bench-kimi-compile timeout 420 python3 benchmarks/train_throughput.py "${KIMI[@]}" --compile \
    --out $BENCH/train_throughput_h200_kimi_compile.json
  exit 0
fi

CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
START=${START:-resources/drafters/h200-2026-12-01-run8}
STEPS_PER_EPOCH=${STEPS_PER_EPOCH:-770}  # runs 7 and 8: 3,853 steps for 5 epochs of this data and shape
VAL_EVERY=${VAL_EVERY:-385}
CORES=${CORES:-16}
: "${TRAIN_END:?the unix time by which training must have ended}"
rm -f logs/h200/EXPORTED logs/h200/DONE
[ -f "$START/model.safetensors" ] || { echo "no warm start drafter in $START" >>logs/h200/progress.log; exit 1; }

timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${CONFIGS[@]}" || exit 1
# STEP_S (and FIRST_S): a step time already measured; the benchmark is then neither waited for nor read.
[ -n "${STEP_S:-}" ] || wait_for logs/h200/BENCH_DONE 900
timed data $SNAKEMAKE --cores "$CORES" --configfile "${CONFIGS[@]}" --until consolidate || exit 1

plan=$(python3 - "$BENCH" "$TRAIN_END" "$STEPS_PER_EPOCH" "${STEP_S:-}" "${FIRST_S:-90}" <<'EOF'
import json, statistics, sys, time
bench, end, per_epoch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
timed = {"compile": (float(sys.argv[4]), float(sys.argv[5]))} if sys.argv[4] else {}
for mode in ("eager", "compile") if not timed else ():
    try:
        run = json.load(open(f"{bench}/train_throughput_h200_smollm2_run9_{mode}.json"))["runs"][0]
        timed[mode] = (statistics.median(run["step_seconds"][4:]), run["step_seconds"][0])
    except Exception:
        pass
timed.setdefault("eager", (0.28, 85.0))  # the eighth run's real step and first-step compile
mode = "compile" if "compile" in timed and timed["compile"][0] < 0.9 * timed["eager"][0] else "eager"
step, first = timed[mode]
epoch_s = per_epoch * step + 2 * 6.0  # two validations an epoch
epochs = max(1, int((end - time.time() - 2 * first) // epoch_s))
print(mode, epochs, step)
EOF
)
read -r mode epochs step_s <<<"$plan"
epochs=${EPOCHS:-$epochs}  # EPOCHS: a chosen number instead of what fits before TRAIN_END
compile=false
[ "$mode" = compile ] && compile=true
printf 'train:\n  epochs: %s\n  val_every: %s\n  init_from: %s\n  compile: %s\n' \
  "$epochs" "$VAL_EVERY" "$START" "$compile" >logs/h200/run9.yaml
echo "$(stamp) $mode step ${step_s}s -> epochs: $epochs (train until $(date -u -d @"$TRAIN_END" +%T))" >>logs/h200/progress.log
RUN=("${CONFIGS[@]}" logs/h200/run9.yaml)
timed train $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until export_drafter || exit 1
touch logs/h200/EXPORTED
# What the evaluation elsewhere needs beside the export: the shards' checksums and the split.
cp results/h200-smollm2/consolidated/index.json results/h200-smollm2/consolidated/split.json logs/h200/ 2>/dev/null
touch logs/h200/DONE
