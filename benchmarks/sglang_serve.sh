#!/usr/bin/env bash
# The drafter served by real SGLang on one GPU, through the workflow's own evaluation stage
# (evaluate.backend: sglang): a plain server and one EAGLE-3 server per drafting setting, all
# MT-bench first turns, greedy, at each concurrency; then the same prompts replayed by the
# transformers evaluator on the GPU (the replay tau); then benchmarks/sglang_serve.py writes
# OUTDIR/sglang_serve.json and prints the table (docs/evaluation.md, "Through SGLang").
#
#   SGLANG_WHEELS=.sglang-wheels TARGET_DIR=resources/models/SmolLM2-135M-Instruct \
#   DRAFTER=<an SGLang export> EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl \
#   bash benchmarks/sglang_serve.sh OUTDIR
#
# Knobs (environment): NUM_PROMPTS (80: all first turns), MAX_NEW_TOKENS (128), CONCURRENCY
# ("1 8 32"), PROFILE_STEPS (32: SGLang's own profile of that many forward steps of one prompt
# per server, broken down by stage; 0 = none), DRAFTING (JSON list, default chain 3/1/4, chain 7/1/8, tree 6/10/60),
# SERVER_ARGS (flags for every server, default "--dtype bfloat16 --mem-fraction-static 0.4";
# SGLang's defaults otherwise: CUDA graphs on), DEVICE (the replay's, default cuda), SITE
# (where the wheels are installed, default /tmp/site), WORK (the workflow's directory).
# DRY_RUN=1 writes the configs and prints the jobs both runs plan, starting nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT="${1:?usage: bash benchmarks/sglang_serve.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SITE="${SITE:-/tmp/site}"
WORK="${WORK:-/tmp/eaglenest-serve}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$WORK/resources/eval"
t0=$(date +%s)
log() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - t0 ))s $*" | tee -a "$OUT/steps.log" >&2; }

if [ -z "${EAGLENEST_SGLANG_COMMAND:-}" ]; then
    # The carried wheels go on the servers' path only (after the launcher's plugin entries):
    # they hold the transformers SGLang pins, which eaglenest's own jobs must not import.
    if [ "${DRY_RUN:-0}" != 1 ] && { [ ! -e "$SITE/.eaglenest-installed" ] || [ -n "$(ls "${SGLANG_WHEELS:-.sglang-wheels}"/*.tar.xz 2>/dev/null)" ]; }; then
        bash envs/sglang_wheels_install.sh "${SGLANG_WHEELS:-.sglang-wheels}" "$SITE" > "$OUT/install.log" 2>&1
        log "install rc=$?"
    fi
    export EAGLENEST_SGLANG_COMMAND="bash -c 'PYTHONPATH=\"\$PYTHONPATH:$SITE\" exec $PY -m sglang.launch_server \"\$@\"' sglang"
fi
[ -e "$WORK/resources/eval/mt_bench_question.jsonl" ] || cp "${EVAL_PROMPTS:?}" "$WORK/resources/eval/mt_bench_question.jsonl"

"$PY" - "$WORK" <<'PYTHON' || exit 1
import json, os, sys
from pathlib import Path

import yaml

work = Path(sys.argv[1])
config = yaml.safe_load(Path("config/config.yaml").read_text())
target = Path(os.environ["TARGET_DIR"]).resolve()
model = json.loads((target / "config.json").read_text())
config["run"] = "serve"
config["target"] = {"name": os.environ.get("TARGET_NAME", target.name), "path": str(target), "embedded": None,
                    "num_layers": model["num_hidden_layers"], "hidden_size": model["hidden_size"],
                    "vocab_size": model["vocab_size"]}
config["extract"].setdefault("sglang", {})["extra_args"] = os.environ.get(
    "SERVER_ARGS", "--dtype bfloat16 --mem-fraction-static 0.4").split()
drafting = json.loads(os.environ.get("DRAFTING", '[{"steps": 3, "topk": 1, "tokens": 4}, '
                                     '{"steps": 7, "topk": 1, "tokens": 8}, {"steps": 6, "topk": 10, "tokens": 60}]'))
config["evaluate"].update(
    drafter=str(Path(os.environ["DRAFTER"]).resolve()), sets=["mt_bench"], num_prompts=int(os.environ.get("NUM_PROMPTS", 80)),
    max_new_tokens=int(os.environ.get("MAX_NEW_TOKENS", 128)), temperature=0, drafting=drafting, backend="sglang",
    sglang={"concurrency": [int(c) for c in os.environ.get("CONCURRENCY", "1 8 32").split()],
            "profile_steps": int(os.environ.get("PROFILE_STEPS", 32))},
)
(work / "serve.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
config["run"] = "serve-replay"
config["evaluate"].update(backend="transformers", method="replay", device=os.environ.get("DEVICE", "cuda"))
del config["evaluate"]["sglang"]
(work / "serve-replay.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
PYTHON
cp "$WORK/serve.yaml" "$WORK/serve-replay.yaml" "$OUT/"

snakemake_in_work() {
    "$PY" -m snakemake --snakefile "$REPO/Snakefile" --directory "$WORK" --configfile "$WORK/$1.yaml" \
        --cores "${CORES:-8}" --resources gpu=1 "${@:2}" -- "results/$1/evaluate/summary.json"
}
if [ "${DRY_RUN:-0}" = 1 ]; then
    for run in serve serve-replay; do
        snakemake_in_work "$run" -n --quiet rules 2>&1 | tee -a "$OUT/steps.log" || exit 1
    done
    exit 0
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/steps.log"
snakemake_in_work serve > "$OUT/serve.log" 2>&1
rc=$?
log "served evaluation rc=$rc"
cp -r "$WORK/logs/serve/sglang/evaluate" "$OUT/server-logs" 2>/dev/null
snakemake_in_work serve-replay > "$OUT/replay.log" 2>&1
log "replay rc=$?"
"$PY" benchmarks/sglang_serve.py --workdir "$WORK" --run serve --replay-run serve-replay --eval-set mt_bench \
    --out "$OUT/sglang_serve.json" | tee "$OUT/table.tsv"
log "collect rc=${PIPESTATUS[0]}"
exit $rc
