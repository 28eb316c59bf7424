#!/usr/bin/env bash
# Measurements the sixth run left open, on one H200 with nothing else on the GPU (about 10 min):
#   1. the SmolLM2 training step at the draft vocabulary the H200 config trains (32,000), eager
#      and with train.compile, each beside the plain eager ceiling of the same shape;
#   2. the Kimi-shaped step at 8 x 4,096 with train.recompute_steps, alone on the GPU;
#   3. bf16 noise over a whole prepared shard: transformers in bfloat16 against itself in
#      float32 on the GPU (benchmarks/sglang_h200.py noise), the bar for SGLang's rows.
#   bash benchmarks/h200_measure.sh     (writes logs/h200/bench/*.json, progress.log, times.tsv)
# Expects, carried in: resources/ (the GGUF), results/h200-smollm2/data/ (the ingested
# conversations) for the one prepared shard that step 3 reads.
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml)
BENCH=logs/h200/bench
SHARD=results/h200-smollm2/prepared/87f8300d5590/shard-00000.safetensors
mkdir -p $BENCH
export TMPDIR=/dev/shm  # the benchmarks' temporary shards and drafters stay off the disk

# The prepared shard (CPU) while the GPU measures the training steps.
timed prepare-shard $SNAKEMAKE --cores 4 --rerun-triggers mtime --configfile "${CONFIGS[@]}" -- \
  resources/models/SmolLM2-135M-Instruct "$SHARD" &
PREPARE=$!
timed bench-smollm2-v32k timeout 300 python3 benchmarks/train_throughput.py --shape smollm2 --rows 8 --token-budget 4096 \
  --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000 --ceiling --steps 10 --warmup 3 \
  --out $BENCH/train_throughput_h200_smollm2_v32k.json
timed bench-smollm2-v32k-compile timeout 400 python3 benchmarks/train_throughput.py --shape smollm2 --rows 8 \
  --token-budget 4096 --sample-len 2048 --hidden-dtype float8_e4m3 --draft-vocab 32000 --compile --steps 10 --warmup 4 \
  --out $BENCH/train_throughput_h200_smollm2_v32k_compile.json
timed bench-kimi-recompute timeout 400 python3 benchmarks/train_throughput.py --shape kimi --rows 8 --token-budget 4096 \
  --sample-len 4096 --recompute-steps --steps 5 --warmup 2 --out $BENCH/train_throughput_h200_kimi_8x4096_recompute_alone.json
wait $PREPARE
timed noise-gpu timeout 300 python3 benchmarks/sglang_h200.py noise --prepared "$SHARD" \
  --target-dir resources/models/SmolLM2-135M-Instruct --rows 914982,622441,583244 --samples 887 --device cuda \
  --threads 4 --tokens-per-batch 65536 --out $BENCH/bf16_noise_transformers_h200.json
touch logs/h200/DONE
