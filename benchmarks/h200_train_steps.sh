#!/usr/bin/env bash
# The training step's measurements of docs/performance.md on one H200, each part within one
# 10-minute call. Every benchmark JSON is written to $DEST as soon as it exists (a node that
# goes away keeps nothing), named by the date and the part.
#   PART=kimi    bash benchmarks/h200_train_steps.sh   # 1 x 4,096 eager beside its ceiling (--check first)
#   PART=profile bash benchmarks/h200_train_steps.sh   # its operator profile over the whole training call
#   PART=anatomy bash benchmarks/h200_train_steps.sh   # benchmarks/train_step_anatomy.py: 1 x 4,096 beside its
#                                                      # ceiling, then the peak of 8 x 4,096 recomputed
#   PART=anatomy-smollm2 bash benchmarks/h200_train_steps.sh  # the SmolLM2 real run's step, compiled and eager
#   PART=anatomy-smollm2-goal bash benchmarks/h200_train_steps.sh  # the goal's SmolLM2 step (below), compiled
#   PART=memory  bash benchmarks/h200_train_steps.sh   # 8 x 4,096 with train.recompute_steps (the 40 GB goal)
#   PART=compile bash benchmarks/h200_train_steps.sh   # Kimi 1 x 4,096 compiled (its first step compiles
#                                                      # for minutes: alone in its call)
#   PART=smollm2 bash benchmarks/h200_train_steps.sh   # SmolLM2 8 x 4,096 compiled beside its ceiling (the
#                                                      # real run's step), then eager
#   PART=smollm2-goal bash benchmarks/h200_train_steps.sh  # the step of the training-speed goal's figure
#                                                      # (2026-11-29: 8 rows of 4,096 in samples of 1,024,
#                                                      # draft vocabulary 8,192), compiled beside its ceiling
#   PART=ddp     bash benchmarks/h200_train_steps.sh   # two H200s of one host: one process against two (DDP)
#                                                      # at the same global batch, SmolLM2 and Kimi (2 x 4,096)
# Needs torch, safetensors, transformers and jsonschema (eaglenest's settings validate against
# config/schema.yaml; an image without it takes its wheel and those of its three dependencies,
# referencing, jsonschema-specifications and rpds-py). The benchmark makes its own random target
# and shards (in TMPDIR, /dev/shm by default).
source "$(dirname "$0")/h200_steps.sh"
# PART may name several, run in that order: PART="kimi memory" fills one 10-minute call.
PART=${PART:?PART=kimi, profile, anatomy, anatomy-smollm2, anatomy-smollm2-goal, memory, compile, smollm2, smollm2-goal or ddp}
DEST=${DEST:-benchmarks/results}
# Files are named by TAG: the date unless given (the commit measured, when a day holds several)
DAY=${TAG:-$(date -u +%F)}
export TMPDIR=${TMPDIR:-/dev/shm}
KIMI=(--shape kimi --token-budget 4096 --sample-len 4096 --steps 8 --warmup 3)
SMOLLM2=(--shape smollm2 --rows 8 --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000
         --steps 10 --warmup 4)
mkdir -p "$DEST"
for part in $PART; do
case $part in
  kimi)  # about 4 minutes on one H200 (2026-12-02); --check first compares the GPU's attention and merge
         # of the diagonal keys with the dense path and autograd's (float32)
    # CHECK= (empty) leaves the check out: a minute less
    timed kimi-1x4096 timeout 400 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 1 --ceiling ${CHECK---check} \
      --out "$DEST/train_throughput_h200_kimi_1x4096_$DAY.json"
    ;;
  profile)
    timed kimi-1x4096-profile timeout 200 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 1 --steps 5 \
      --warmup 2 --profile --out "$DEST/train_throughput_h200_kimi_1x4096_profile_$DAY.json"
    ;;
  anatomy)  # where the Kimi-shaped step's time goes (phases, ablations, kernels by kind, beside the ceiling),
            # then the peak of 8 x 4,096 with train.recompute_steps from the same step (no shards to write)
    timed kimi-1x4096-anatomy timeout 300 python3 benchmarks/train_step_anatomy.py --shape kimi --rows 1 \
      --token-budget 4096 --sample-len 4096 --out "$DEST/train_step_anatomy_h200_kimi_1x4096_$DAY.json"
    timed kimi-8x4096-recompute-peak timeout 240 python3 benchmarks/train_step_anatomy.py --shape kimi --rows 8 \
      --token-budget 4096 --sample-len 4096 --recompute-steps --steps 3 --warmup 1 --no-ablations --no-ceiling \
      --no-profile --out "$DEST/train_step_anatomy_h200_kimi_8x4096_recompute_$DAY.json"
    ;;
  anatomy-smollm2)  # the same for the SmolLM2 real run's step, compiled (train.compile), and eager
    timed smollm2-anatomy-compile timeout 400 python3 benchmarks/train_step_anatomy.py --shape smollm2 --rows 8 \
      --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000 --compile \
      --out "$DEST/train_step_anatomy_h200_smollm2_8x4096_compile_$DAY.json"
    timed smollm2-anatomy-eager timeout 200 python3 benchmarks/train_step_anatomy.py --shape smollm2 --rows 8 \
      --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000 \
      --out "$DEST/train_step_anatomy_h200_smollm2_8x4096_$DAY.json"
    ;;
  anatomy-smollm2-goal)
    timed smollm2-goal-anatomy-compile timeout 330 python3 benchmarks/train_step_anatomy.py --shape smollm2 --rows 8 \
      --token-budget 4096 --sample-len 1024 --compile \
      --out "$DEST/train_step_anatomy_h200_smollm2_goal_shape_compile_$DAY.json"
    ;;
  memory)  # 8 x 4,096 Kimi rows are 15 GB of random shards to write first: about 4 minutes
    timed kimi-8x4096-recompute timeout 500 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 8 \
      --steps 6 --warmup 2 --recompute-steps --out "$DEST/train_throughput_h200_kimi_8x4096_recompute_$DAY.json"
    ;;
  compile)
    timed kimi-1x4096-compile timeout 560 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 1 --compile \
      --out "$DEST/train_throughput_h200_kimi_1x4096_compile_$DAY.json"
    ;;
  smollm2)  # about 5 minutes, most of it the first step's compile
    timed smollm2-8x4096-compile timeout 400 python3 benchmarks/train_throughput.py "${SMOLLM2[@]}" --compile --ceiling \
      --out "$DEST/train_throughput_h200_smollm2_8x4096_compile_$DAY.json"
    timed smollm2-8x4096-eager timeout 150 python3 benchmarks/train_throughput.py "${SMOLLM2[@]}" \
      --out "$DEST/train_throughput_h200_smollm2_8x4096_eager_$DAY.json"
    ;;
  smollm2-goal)
    timed smollm2-goal-compile timeout 400 python3 benchmarks/train_throughput.py --shape smollm2 --rows 8 \
      --token-budget 4096 --sample-len 1024 --steps 10 --warmup 4 --compile --ceiling \
      --out "$DEST/train_throughput_h200_smollm2_goal_shape_compile_$DAY.json"
    ;;
  ddp)
    timed smollm2-8x4096-ddp timeout 280 python3 benchmarks/train_throughput.py "${SMOLLM2[@]}" --compile \
      --processes 1 --processes 2 --out "$DEST/train_throughput_h200x2_smollm2_8x4096_ddp_$DAY.json"
    timed kimi-2x4096-ddp timeout 300 python3 benchmarks/train_throughput.py "${KIMI[@]}" --rows 2 \
      --processes 1 --processes 2 --out "$DEST/train_throughput_h200x2_kimi_2x4096_ddp_$DAY.json"
    ;;
  *) echo "PART is kimi, profile, anatomy, anatomy-smollm2, anatomy-smollm2-goal, memory, compile, smollm2, smollm2-goal or ddp, not $part" >&2; exit 2 ;;
esac
done
