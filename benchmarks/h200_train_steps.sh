#!/usr/bin/env bash
# The training step's measurements of docs/performance.md on one H200, each part within one
# 10-minute call. Every benchmark JSON is written to $DEST as soon as it exists (a node that
# goes away keeps nothing), named by the date and the part.
#   PART=kimi    bash benchmarks/h200_train_steps.sh   # 1 x 4,096 eager beside its ceiling, then 8 x 4,096
#                                                      # with train.recompute_steps (the 40 GB goal)
#   PART=compile bash benchmarks/h200_train_steps.sh   # Kimi 1 x 4,096 compiled; SmolLM2 8 x 4,096 compiled
#                                                      # beside its ceiling (the real run's step)
#   PART=ddp     bash benchmarks/h200_train_steps.sh   # two H200s of one host: one process against two (DDP)
#                                                      # at the same global batch, SmolLM2 and Kimi (2 x 4,096)
# Only torch, safetensors and transformers are needed: the benchmark makes its own random target
# and shards (in TMPDIR, /dev/shm by default).
source "$(dirname "$0")/h200_steps.sh"
PART=${PART:?PART=kimi, compile or ddp}
DEST=${DEST:-benchmarks/results}
DAY=$(date -u +%F)
export TMPDIR=${TMPDIR:-/dev/shm}
KIMI=(--shape kimi --token-budget 4096 --sample-len 4096 --steps 8 --warmup 3)
SMOLLM2=(--shape smollm2 --rows 8 --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000
         --steps 10 --warmup 4)
mkdir -p "$DEST"
case $PART in
  kimi)
    timed kimi-1x4096 timeout 280 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 1 --ceiling \
      --out "$DEST/train_throughput_h200_kimi_1x4096_$DAY.json"
    timed kimi-8x4096-recompute timeout 280 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 8 \
      --recompute-steps --out "$DEST/train_throughput_h200_kimi_8x4096_recompute_$DAY.json"
    ;;
  compile)
    timed kimi-1x4096-compile timeout 300 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 1 --compile \
      --out "$DEST/train_throughput_h200_kimi_1x4096_compile_$DAY.json"
    timed smollm2-8x4096-compile timeout 280 python3 benchmarks/train_throughput.py "${SMOLLM2[@]}" --compile --ceiling \
      --out "$DEST/train_throughput_h200_smollm2_8x4096_compile_$DAY.json"
    ;;
  ddp)
    timed smollm2-8x4096-ddp timeout 280 python3 benchmarks/train_throughput.py "${SMOLLM2[@]}" --compile \
      --processes 1 --processes 2 --out "$DEST/train_throughput_h200x2_smollm2_8x4096_ddp_$DAY.json"
    timed kimi-2x4096-ddp timeout 300 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 2 \
      --processes 1 --processes 2 --out "$DEST/train_throughput_h200x2_kimi_2x4096_ddp_$DAY.json"
    ;;
  *) echo "PART is kimi, compile or ddp, not $PART" >&2; exit 2 ;;
esac
