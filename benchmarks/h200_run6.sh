#!/usr/bin/env bash
# The sixth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): run 5's
# data, split, draft vocabulary, references and shape (8 rows of 4,096 tokens), trained for
# $EPOCHS epochs (default 3) with the loader's two fixes (fp8 rows dequantized on the GPU, every
# step padded to one shape; docs/performance.md), to see where validation accuracy levels off.
# One Snakemake invocation runs the whole workflow, so training starts as soon as consolidation
# ends while the greedy references still decode on the CPU cores. Beside it:
#   - while prepare runs on the CPU: the training step's benchmark at this shape (it also warms
#     the compile cache the training then reuses), then the Kimi-shaped step at 8 x 4,096 with
#     train.recompute_steps (its peak memory; its speed is beside the extraction);
#   - beside the training: benchmarks/sglang_h200.sh's extract phase (the plugin against the
#     transformers backend, bfloat16 both);
#   - after the export, beside the replay on the CPU cores: its serve phase (plain SGLang and
#     this run's export with EAGLE-3, one server at a time on an otherwise idle GPU).
#   bash benchmarks/h200_run6.sh    (writes logs/h200/: progress.log, times.tsv, one log per
#                                    step, bench/*.json, sglang/, and DONE at the end)
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations); the SGLang wheel archives arrive in $SGLANG_WHEELS (with READY)
# while it runs.
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
EPOCHS=${EPOCHS:-3}
CORES=${CORES:-13}                     # the rest of the 16 serve SGLang's processes
SGLANG_WHEELS=${SGLANG_WHEELS:-.sglang-wheels}
SGLANG_SITE=${SGLANG_SITE:-/tmp/sglang-site}
SGLANG_DELAY_S=${SGLANG_DELAY_S:-60}   # start SGLang once the training holds its memory
RUN_DIR=results/h200-smollm2
BENCH=logs/h200/bench
mkdir -p logs/h200 $BENCH
rm -f logs/h200/DONE
printf 'train:\n  epochs: %s\n' "$EPOCHS" >logs/h200/epochs.yaml
echo "$(stamp) epochs: $EPOCHS" >>logs/h200/progress.log


timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${CONFIGS[@]}" || exit 1

timed pipeline $SNAKEMAKE --cores "$CORES" --keep-going --configfile "${CONFIGS[@]}" logs/h200/epochs.yaml &

# The benchmarks' temporary data (the Kimi-shaped drafter alone is 3.5 GB) and SGLang's copies
# of a shard go to memory: the disk holds the run's 50 GB of hidden states, and once a
# benchmark's /tmp filled it, the disk preflight refused the last shards (docs/results.md).
( # GPU while prepare runs: the step benchmarks
  export TMPDIR=/dev/shm
  timed bench-train timeout 240 python3 benchmarks/train_throughput.py --shape smollm2 --rows 8 --token-budget 4096 \
    --sample-len 2048 --hidden-dtype float8_e4m3 --steps 10 --warmup 3 --out "$BENCH/train_throughput_h200_smollm2_run6.json"
  timed bench-kimi timeout 300 python3 benchmarks/train_throughput.py --shape kimi --rows 8 --token-budget 4096 \
    --sample-len 4096 --recompute-steps --steps 4 --warmup 2 --out "$BENCH/train_throughput_h200_kimi_8x4096_recompute.json"
) &

( # SGLang: install as soon as the wheels are here; extract beside the training; serve after it
  wait_for "$SGLANG_WHEELS/READY" 900 || exit 0
  timed sglang-install bash envs/sglang_wheels_install.sh "$SGLANG_WHEELS" "$SGLANG_SITE"
  wait_for "$RUN_DIR/consolidated/index.json" 1500 || exit 0
  sleep "$SGLANG_DELAY_S"
  shard=$(ls $RUN_DIR/prepared/*/shard-00000.safetensors | head -1)
  export SITE=$SGLANG_SITE SGLANG_WHEELS TARGET_DIR=resources/models/SmolLM2-135M-Instruct PREPARED_SHARD=$shard \
    DRAFTER_EXPORT=$RUN_DIR/export/sglang EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl MEM_FRACTION=0.25 \
    SHARD_WORK=/dev/shm/eaglenest-sglang-shards IMPORT_TEST=sglang
  PHASES=extract TIME_LIMIT_S=480 timed sglang-extract bash benchmarks/sglang_h200.sh logs/h200/sglang
  wait_for "$RUN_DIR/export/export_report.json" 1500 || exit 0
  PHASES=serve TIME_LIMIT_S=${SGLANG_SERVE_LIMIT_S:-480} timed sglang-serve bash benchmarks/sglang_h200.sh logs/h200/sglang
) &

wait
touch logs/h200/DONE
