#!/usr/bin/env bash
# Real SGLang 0.5.14 on one H200, beside other GPU work: the extraction plugin against the
# transformers backend, the unpatched server refused, and an eaglenest drafter served with
# EAGLE-3 (chain 3/1/4 and one tree) against plain decoding. docs/sglang.md, "On the H200".
#
#   SGLANG_WHEELS=.sglang-wheels TARGET_DIR=... PREPARED_SHARD=... DRAFTER_EXPORT=... \
#   EVAL_PROMPTS=.../question.jsonl bash benchmarks/sglang_h200.sh OUTDIR
#
# Every step is logged with timestamps in OUTDIR/steps.log and OUTDIR/logs/<step>.log; a
# step that fails is recorded (OUTDIR/steps.jsonl) and the next independent step runs.
# The whole run stops after TIME_LIMIT_S (default 720) and still writes OUTDIR/results.json.
# DRY_RUN=1 prints the commands and runs nothing on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash benchmarks/sglang_h200.sh OUTDIR}"
mkdir -p "$OUT/logs" "$OUT/parts"
OUT="$(cd "$OUT" && pwd)"
SGLANG_WHEELS="${SGLANG_WHEELS:-.sglang-wheels}"
TARGET_DIR="${TARGET_DIR:-resources/models/SmolLM2-135M-Instruct}"
TARGET_NAME="${TARGET_NAME:-SmolLM2-135M-Instruct}"
PREPARED_SHARD="${PREPARED_SHARD:-}"
DRAFTER_EXPORT="${DRAFTER_EXPORT:-}"
EVAL_PROMPTS="${EVAL_PROMPTS:-}"
MEM_FRACTION="${MEM_FRACTION:-0.25}"
SITE="${SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
TIME_LIMIT_S="${TIME_LIMIT_S:-720}"
DRY_RUN="${DRY_RUN:-0}"
NUM_PROMPTS="${NUM_PROMPTS:-20}"
# extract: the plugin against the transformers backend; serve: plain decoding and EAGLE-3. A
# driver can run them apart, e.g. extraction beside training and serving on a quiet GPU.
PHASES="${PHASES:-extract serve}"
# The two extracted copies of the shard (about 4 GB each for SmolLM2 in bf16): on a node whose
# disk holds a run's hidden states, put them in memory (SHARD_WORK=/dev/shm/...).
SHARD_WORK="${SHARD_WORK:-$OUT/shards}"
START=$(date +%s)
DEADLINE=$((START + TIME_LIMIT_S))
# Known to serve on the node: real weights, Triton attention, no CUDA graphs, no grammar backend.
# --dtype bfloat16: the converted SmolLM2 config says float32, which SGLang's dtype "auto" serves
# in float16 (sglang/srt/configs/model_config.py:1573-1589 in 0.5.14), while an eaglenest
# export is bfloat16: EAGLE-3's fc then meets float16 hidden states and the first draft fails
# ("expected mat1 and mat2 to have the same dtype"). bfloat16 is also what the transformers
# backend extracts in, so the plugin comparison compares like with like.
COMMON_FLAGS=(--load-format auto --dtype bfloat16 --attention-backend triton --sampling-backend pytorch --disable-cuda-graph
              --grammar-backend none --log-level info)
SERVER_FLAGS=("${COMMON_FLAGS[@]}" --tp-size 1)
SPOOL=/dev/shm/eaglenest_hs_h200
PIDS=()

log() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s $*" | tee -a "$OUT/steps.log" >&2; }
has_phase() { [[ " $PHASES " == *" $1 "* ]]; }
left() { echo $(( DEADLINE - $(date +%s) )); }

# run_step NAME CMD...: timed, logged, bounded by what is left of the time limit (30 s kept
# for stopping servers and writing results.json); never stops the script.
run_step() {
    local name="$1"; shift
    local budget=$(( $(left) - 30 ))
    local t0=$(date +%s) rc
    if [ "$budget" -le 5 ]; then
        log "SKIP $name: out of time"; rc=125
    elif [ "$DRY_RUN" = 1 ]; then
        log "DRY $name: $*"; rc=0
    else
        log "START $name (budget ${budget}s)"
        timeout -k 10 "$budget" "$@" > "$OUT/logs/$name.log" 2>&1
        rc=$?
        log "END $name rc=$rc in $(( $(date +%s) - t0 ))s"
        [ "$rc" = 0 ] || tail -n 15 "$OUT/logs/$name.log" | sed "s/^/    $name| /" | tee -a "$OUT/steps.log" >&2
    fi
    printf '{"step": "%s", "rc": %d, "seconds": %d, "log": "logs/%s.log"}\n' "$name" "$rc" $(( $(date +%s) - t0 )) "$name" >> "$OUT/steps.jsonl"
    return "$rc"
}

# start_server NAME PORT CMD...: in its own session (so that its whole group can be stopped).
start_server() {
    local name="$1" port="$2"; shift 2
    if [ "$DRY_RUN" = 1 ]; then log "DRY server $name on :$port: $*"; return 0; fi
    log "START server $name on :$port"
    setsid "$@" > "$OUT/logs/server-$name.log" 2>&1 &
    PIDS+=($!)
    eval "PID_$name=$!"
}

stop_server() {
    local name="$1" pid
    eval "pid=\${PID_$name:-}"
    [ -n "$pid" ] || return 0
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    eval "PID_$name="
    log "STOP server $name"
}

# wait_ready NAME URL PATH: until URL/PATH answers 200, the server exits, or time runs out.
wait_ready() {
    local name="$1" url="$2" path="$3" pid t0=$(date +%s)
    [ "$DRY_RUN" = 1 ] && return 0
    eval "pid=\${PID_$name:-}"
    while [ "$(left)" -gt 40 ]; do
        if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
            log "server $name exited before it was ready"; tail -n 20 "$OUT/logs/server-$name.log" >&2; return 1
        fi
        if "$PY" -c "import sys,urllib.request; sys.exit(0 if urllib.request.urlopen('$url$path', timeout=3).status == 200 else 1)" 2>/dev/null; then
            log "server $name ready after $(( $(date +%s) - t0 ))s"; return 0
        fi
        sleep 2
    done
    log "server $name not ready in time"; return 1
}

cleanup() {
    for name in patched plain chain tree; do stop_server "$name"; done
    rm -rf "$SPOOL"
    "$PY" benchmarks/sglang_h200.py merge --parts "$OUT/parts" --steps "$OUT/steps.jsonl" --out "$OUT/results.json" \
        > "$OUT/logs/merge.log" 2>&1 || log "merge failed: see $OUT/logs/merge.log"
    log "done: $OUT/results.json"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

log "sglang_h200: OUT=$OUT TARGET_DIR=$TARGET_DIR PREPARED_SHARD=$PREPARED_SHARD DRAFTER_EXPORT=$DRAFTER_EXPORT MEM_FRACTION=$MEM_FRACTION limit ${TIME_LIMIT_S}s"
for v in TARGET_DIR PREPARED_SHARD DRAFTER_EXPORT EVAL_PROMPTS; do
    [ -e "${!v}" ] || log "WARNING: $v=${!v} does not exist; the steps that need it will fail"
done

# --- a. install the carried wheels into $SITE once per machine, import-test ------------------
run_step install bash envs/sglang_wheels_install.sh "$SGLANG_WHEELS" "$SITE"
run_step environment bash -c "nvidia-smi; nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv; nproc; uptime;
    PYTHONPATH=$SITE $PY -c 'import torch, triton, transformers, sglang, sgl_kernel, flashinfer; print(torch.__version__, triton.__version__, transformers.__version__, sglang.__version__)'"
SGL_ENV=(env PYTHONPATH="$SITE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 SGLANG_DISABLE_REQUEST_LOGGING=1)

# --- b. the patched server (through our launcher): one shard against the transformers backend
PATCHED_URL=http://127.0.0.1:30010
PLAIN_URL=http://127.0.0.1:30011
if has_phase extract; then
    run_step patched-config "$PY" benchmarks/sglang_h200.py config --out "$OUT/patched-config.yaml" --target-dir "$TARGET_DIR" \
        --target-name "$TARGET_NAME" --url "$PATCHED_URL" --spool-dir "$SPOOL" -- \
        --mem-fraction-static "$MEM_FRACTION" "${COMMON_FLAGS[@]}"
    start_server patched 30010 "${SGL_ENV[@]}" "$PY" -m eaglenest.sglang.launch --configfile "$OUT/patched-config.yaml" --state-dir "$OUT/patched"
    if wait_ready patched "$PATCHED_URL" /eaglenest/info; then
        # The client and the transformers backend run on the node's own transformers (not $SITE's).
        run_step extract "$PY" benchmarks/sglang_h200.py extract --out "$OUT/parts/extract.json" --target-dir "$TARGET_DIR" \
            --target-name "$TARGET_NAME" --url "$PATCHED_URL" --spool-dir "$SPOOL" --prepared "$PREPARED_SHARD" --work "$SHARD_WORK"
        grep -h "eaglenest capture" "$OUT/patched/server.log" 2>/dev/null | head -5 | tee -a "$OUT/steps.log" >&2
    else
        run_step extract false
    fi
    stop_server patched
fi
has_phase serve || exit 0

# --- c. a plain server: refused by the client, and the decoding speed without speculation ----
# Servers run one at a time from here: each one's tokens/s is measured on an otherwise idle
# GPU (a booting server compiles kernels and runs warm-up batches), and SGLang 0.5.14 sizes
# its KV pool as the free memory after loading minus (1 - mem_fraction_static) x the free
# memory before loading (model_runner_kv_cache_mixin.py:_profile_available_bytes), so a
# server allocated between those two readings of another leaves that one none.
start_server plain 30011 "${SGL_ENV[@]}" "$PY" -m sglang.launch_server --model-path "$TARGET_DIR" --served-model-name "$TARGET_NAME" \
    --port 30011 --mem-fraction-static "$MEM_FRACTION" "${SERVER_FLAGS[@]}"
if wait_ready plain "$PLAIN_URL" /health; then
    run_step refuse "$PY" benchmarks/sglang_h200.py refuse --out "$OUT/parts/refuse.json" --target-name "$TARGET_NAME" --url "$PLAIN_URL"
    run_step generate-plain "$PY" benchmarks/sglang_h200.py generate --out "$OUT/parts/generate-plain.json" --label plain \
        --target-dir "$TARGET_DIR" --url "$PLAIN_URL" --questions "$EVAL_PROMPTS" --num-prompts "$NUM_PROMPTS"
else
    run_step refuse false
fi
stop_server plain

# --- d. our drafter with EAGLE-3: chain 3/1/4, then a tree 6/10/60 ------------------------------
EAGLE=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFTER_EXPORT" --speculative-draft-attention-backend triton)
for setting in "chain:30012:3:1:4" "tree:30013:6:10:60"; do
    IFS=: read -r name port steps topk tokens <<<"$setting"
    start_server "$name" "$port" "${SGL_ENV[@]}" "$PY" -m sglang.launch_server --model-path "$TARGET_DIR" --port "$port" \
        --mem-fraction-static "$MEM_FRACTION" "${SERVER_FLAGS[@]}" "${EAGLE[@]}" \
        --speculative-num-steps "$steps" --speculative-eagle-topk "$topk" --speculative-num-draft-tokens "$tokens"
    if wait_ready "$name" "http://127.0.0.1:$port" /health; then
        run_step "generate-$name" "$PY" benchmarks/sglang_h200.py generate --out "$OUT/parts/generate-$name.json" --label "$name" \
            --target-dir "$TARGET_DIR" --url "http://127.0.0.1:$port" --questions "$EVAL_PROMPTS" --num-prompts "$NUM_PROMPTS"
        [ "$DRY_RUN" = 1 ] || "$PY" -c "import json,urllib.request; print(json.dumps(json.load(urllib.request.urlopen('http://127.0.0.1:$port/get_server_info', timeout=10)), indent=1, default=str))" \
            > "$OUT/parts/server-info-$name.json" 2>> "$OUT/logs/generate-$name.log"
    else
        run_step "generate-$name" false
    fi
    stop_server "$name"
done
