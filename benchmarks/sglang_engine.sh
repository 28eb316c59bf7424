#!/usr/bin/env bash
# One GPU run of benchmarks/sglang_engine.py for one target shape: install the carried SGLang
# wheels (once per machine), build the random-weight target, then the ceiling, the disk, the
# patched server with the workflow's client and the transformers backend (docs/sglang.md).
#
#   SGLANG_WHEELS=.sglang-wheels CONFIG_DIR=<SmolLM2 config + tokenizer> PREPARED=<shard> \
#   bash benchmarks/sglang_engine.sh SHAPE SAMPLES OUTDIR [extract options...]
#
# SHAPE: smollm2 (CONFIG_DIR's config as it is) or llama8b; SAMPLES: the shard's first N (0: all).
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE="${1:?shape}" SAMPLES="${2:?samples}" OUTDIR="${3:?outdir}"
shift 3
SITE="${SITE:-/tmp/site}" WORK="${WORK:-/tmp/eaglenest-engine}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUTDIR" "$WORK"
t0=$(date +%s)
if [ ! -e "$SITE/.eaglenest-installed" ] || [ -n "$(ls "${SGLANG_WHEELS:-.sglang-wheels}"/*.tar.xz 2>/dev/null)" ]; then
    bash envs/sglang_wheels_install.sh "${SGLANG_WHEELS:-.sglang-wheels}" "$SITE" > "$OUTDIR/install-$SHAPE.log" 2>&1
    echo "install rc=$? +$(( $(date +%s) - t0 ))s"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; df -h "$WORK" | tail -1
TARGET="$WORK/target-$SHAPE"
[ -f "$TARGET/config.json" ] || python3 benchmarks/sglang_engine.py random-target --config-dir "${CONFIG_DIR:?}" --shape "$SHAPE" --out "$TARGET" || exit 1
echo "target ready +$(( $(date +%s) - t0 ))s"
rm -rf "$WORK/run-$SHAPE"
python3 benchmarks/sglang_engine.py extract --target-dir "$TARGET" --shape "$SHAPE" --target-name "random-$SHAPE" \
    --prepared "${PREPARED:?}" --samples "$SAMPLES" --work "$WORK/run-$SHAPE" --site "$SITE" \
    --out "$OUTDIR/sglang_engine_$SHAPE.json" "$@"
rc=$?
# The servers' logs and the profiles in one archive beside the JSON (a node may return few files).
tar czf "$OUTDIR/logs-$SHAPE.tar.gz" -C "$WORK/run-$SHAPE" $(cd "$WORK/run-$SHAPE" && ls -d logs patched-state-*/server.log profiles 2>/dev/null)
echo "extract rc=$rc +$(( $(date +%s) - t0 ))s"
exit $rc
