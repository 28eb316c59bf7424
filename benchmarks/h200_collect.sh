#!/usr/bin/env bash
# What comes back from the fourth H200 run (benchmarks/h200_run4.sh): one archive of the small
# files (logs, throughput JSONs, training curves and summaries, evaluation metrics, export
# reports, Snakemake job times, the SGLang results) and BEST_RUN's SGLang export in parts of
# 12 MB (bf16 weights without the embedding, with its config and checksum).
#   bash benchmarks/h200_collect.sh OUTDIR BEST_RUN
set -u
cd "$(dirname "$0")/.."
OUT=$1
BEST=${2:-h200-smollm2-long}
mkdir -p "$OUT"
find results/h200-smollm2 results/h200-smollm2-long -type f \
  \( -name '*.json' -o -name '*.tsv' -o -name '*.png' -o -name '*.svg' \) \
  -not -path '*/prepared/*' -not -path '*/hidden/*' -not -path '*/data/*' -not -path '*/checkpoints/*' \
  >/tmp/collect.list 2>/dev/null
find logs benchmarks/jobs -type f -size -20M >>/tmp/collect.list 2>/dev/null
tar -cJf "$OUT/run4-files.tar.xz" -T /tmp/collect.list
export_dir=results/$BEST/export/sglang
if [ -f "$export_dir/model.safetensors" ]; then
  cp "$export_dir/config.json" "$OUT/drafter-config.json"
  sha256sum "$export_dir/model.safetensors" | cut -d' ' -f1 >"$OUT/drafter-model.sha256"
  split -b 12000000 -d -a 1 "$export_dir/model.safetensors" "$OUT/drafter-model.safetensors.part-"
fi
ls -la "$OUT"
