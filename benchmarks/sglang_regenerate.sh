#!/usr/bin/env bash
# Regeneration through the SGLang server that the workflow starts, beside the engine's own
# speed, on one GPU node (docs/regeneration.md, "Through SGLang on one H200"):
#
# 1. the target's conversion (the workflow, --until convert_embedded_target);
# 2. the ceiling: a plain SGLang server (no eaglenest code), started with the flags the
#    launcher gives the regeneration server (and, with CEILING_SWEEP, once more per flag set),
#    answers a seeded sample of the turns' prompts (CEILING_TURNS: all, the default, or first)
#    with the run's sampling settings, CEILING_CONCURRENCY requests in flight;
# 3. the workflow's regenerate stage (rule regenerate, its server started by rule
#    regenerate_server), stopped after REGENERATE_TIMEOUT_S if set (a rerun makes only the
#    missing shards);
# 4. benchmarks/sglang_regenerate.py summary: every turn accounted for, generated and kept
#    tokens per second against the ceiling -> OUTDIR/sglang_regenerate.json and a table;
# 5. the regenerated folder, packed into OUTDIR/regenerated.tar.xz.part-NN (PART_MIB, 15).
#
#   SGLANG_WHEELS=.sglang-wheels bash benchmarks/sglang_regenerate.sh OUTDIR [config files...]
#
# Config files default to config/h200-smollm2.yaml config/h200/carried-data.yaml
# config/h200/regenerated-sampled-server.yaml (all of ShareGPT, sampled, loop-stopped); the
# checkout needs what they read (the GGUF in resources/wheels/, results/<run>/data/).
# DRY_RUN=1 prints the ceiling server's command and the jobs the workflow plans, starting nothing.
# Knobs (environment): CEILING_PROMPTS (2048; 0 skips the ceiling), CEILING_CONCURRENCY (the
# requests the workflow keeps in flight: regenerate.concurrency x the number of shards),
# CEILING_SWEEP (flag sets separated by ";", each measured by a plain server of its own on top
# of the config's flags; FLAGS@N measures that set at N requests in flight; words NAME=VALUE
# (NAME of [A-Z_][A-Z0-9_]*) go into that server's environment, not its flags, for the knobs
# SGLang reads only from there, e.g. "SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT=1
# --scheduler-recv-interval 16@1008"; the fastest of them and the config's own becomes the
# ceiling, and the regeneration server runs with its flags and environment, and with its
# requests in flight shared by the shard jobs when it had its own N: OUTDIR/server-flags.yaml),
# SERVER_START_TIMEOUT_S (600: a plain server not answering /health by then is skipped),
# PROFILE_STEPS (32; 0 = none: SGLang's profile of that many steps of each plain server,
# CEILING_PROFILE_AFTER_S (5) after its ceiling's load started (the client's warm-up request
# done), and of the workflow's, WORKFLOW_PROFILE_AFTER_S (90) after it is ready and again
# WORKFLOW_PROFILE_LATE_S (300; 0 = none) after it, when its batch has grown ->
# OUTDIR/profile-*.json, broken down by stage and forward mode; traces in OUTDIR/profiles/),
# CPU_SAMPLE_S (60; 0 = none: the cores each part of the workflow's run keeps busy, SGLang's
# processes and the clients, sampled from /proc for that long, CPU_SAMPLE_AFTER_S after its
# server is ready, by default 30 s after the profile -> OUTDIR/cpu-workflow.json, in the
# summary), CEILING_CPU_S (10; 0 = none) and CEILING_CPU_AFTER_S (8: into each ceiling's load ->
# OUTDIR/cpu-ceiling-*.json), WORKFLOW_CLIENT_CEILING (1; 0 = none: after the config's own ceiling, the
# same prompts on the same server through the stage's own streamed client, `ceiling --client
# workflow` -> OUTDIR/client-workflow.json and OUTDIR/cpu-client-workflow.json),
# WORKFLOW_CLIENT_INTERVALS (e.g. "16 64": that client once per regenerate.stream_interval ->
# OUTDIR/client-workflow-iN.json; the fastest, by kept tokens/s, goes into the overlay the
# workflow's server and clients run with), PYSPY (1; 0 = none: py-spy on each SGLang process
# over each CPU sample's seconds, when installed -> OUTDIR/cpu-*-pyspy/ and a summary per
# thread in the cpu-*.json: leaf and inclusive frames),
# GC_STATS (1; 0 = none: each process of the workflow's server writes the time its garbage
# collections took, eaglenest/sglang/gc_stats.py -> OUTDIR/gc/, the share per process in the summary),
# SERVER_METRICS (1; 0 = none: every server here started with --enable-metrics, its radix
# cache's evictions, batch and KV use scraped from /metrics -> OUTDIR/metrics-ceiling-*.json,
# OUTDIR/metrics-workflow.json every METRICS_EVERY_S (20), in the summary),
# REGENERATE_TIMEOUT_S, SHARDS (e.g. "0 1 2": those shards only), CORES (snakemake --cores, default nproc), SITE (/tmp/site), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT="${1:?usage: bash benchmarks/sglang_regenerate.sh OUTDIR [config files...]}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/regenerated-sampled-server.yaml)
SITE="${SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
log() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - t0 ))s $*" | tee -a "$OUT/steps.log" >&2; }

if [ -z "${EAGLENEST_SGLANG_COMMAND:-}" ]; then
    if [ ! -e "$SITE/.eaglenest-installed" ] || [ -n "$(ls "${SGLANG_WHEELS:-.sglang-wheels}"/*.tar.xz 2>/dev/null)" ]; then
        bash envs/sglang_wheels_install.sh "${SGLANG_WHEELS:-.sglang-wheels}" "$SITE" > "$OUT/install.log" 2>&1
        log "install rc=$?"
    fi
    # The wheels go on the servers' path only: they pin their own transformers.
    export EAGLENEST_SGLANG_COMMAND="bash -c 'PYTHONPATH=\"\$PYTHONPATH:$SITE\" exec $PY -m sglang.launch_server \"\$@\"' sglang"
fi
# Targets and options first: --configfile takes every word after it. LIMIT: a command that
# bounds the run (timeout), empty by default.
LIMIT=()
snakemake_run() { "${LIMIT[@]}" "$PY" -m snakemake "$@" --cores "${CORES:-$(nproc)}" --configfile "${CONFIGS[@]}"; }
# The run's name, the target and the plain server's command, from the config as the Snakefile sees it.
eval "$("$PY" - "${CONFIGS[@]}" <<'PYTHON'
import os, shlex, sys
from pathlib import Path

from eaglenest import layout, plan
from eaglenest.node.recon.config import load_config
from eaglenest.sglang import launch

config = load_config(Path.cwd(), sys.argv[1:])
command = launch.launch_command(config, {"mode": "serve", "tensor_parallel": config["target"].get("tensor_parallel", 1)},
                                url="http://127.0.0.1:30030")
print(f"RUN={shlex.quote(config['run'])} MODEL={shlex.quote(str(config['target']['path']))}")
run_layout = layout.RunLayout(config)
print(f"RECORD={shlex.quote(run_layout.regenerate_server_record())}")
# What the workflow keeps in flight: each shard job's share, all shard jobs side by side.
print(f"CONFIG_IN_FLIGHT={config['regenerate']['concurrency'] * plan.num_shards(config)}")
shards = os.environ.get("SHARDS", "").split()  # a subset: those shards only (a rerun makes the rest)
targets = [run_layout.regenerated_path(f"shard-{int(shard):05d}.jsonl") for shard in shards]
print("TARGETS=(" + " ".join(shlex.quote(t) for t in targets) + ")")
print("PLAIN=(" + " ".join(shlex.quote(part) for part in command) + ")")
# The config's own server environment (extract.sglang.env): every plain server's.
env = config["extract"]["sglang"].get("env") or {}
print("CONFIG_ENV=(" + " ".join(shlex.quote(f"{name}={value}") for name, value in env.items()) + ")")
# The launcher freezes its server's garbage collector once it is ready (extract.sglang.freeze_gc): so does every plain server.
print(f"FREEZE_GC={int(launch.sglang_settings(config)['freeze_gc'])}")
PYTHON
)" || { log "config unreadable"; exit 1; }
# SGLang's own metrics (radix cache evictions, batch, KV use) from every server it starts here.
[ "${SERVER_METRICS:-1}" = 1 ] && PLAIN+=(--enable-metrics)
printf '%s\n' "${CONFIGS[@]}" > "$OUT/configs.txt"
if [ ${#TARGETS[@]} -gt 0 ]; then UNTIL=("${TARGETS[@]}"); else UNTIL=(--until regenerate_report); fi
# One CEILING_SWEEP entry, [NAME=VALUE...] [FLAGS...][@IN_FLIGHT], split: the NAME=VALUE words
# go into the plain server's environment (SGLang reads some scheduler knobs only from there).
split_entry() {  # entry, default requests in flight -> ENTRY_IN_FLIGHT, ENTRY_ENV, ENTRY_FLAGS
    local entry="$1" word words
    ENTRY_IN_FLIGHT="$2"
    ENTRY_ENV=()
    ENTRY_FLAGS=()
    [[ "$entry" == *@* ]] && ENTRY_IN_FLIGHT="${entry##*@}" && entry="${entry%@*}"
    read -r -a words <<< "$entry"
    for word in "${words[@]}"; do
        if [[ "$word" =~ ^[A-Z_][A-Z0-9_]*= ]]; then ENTRY_ENV+=("$word"); else ENTRY_FLAGS+=("$word"); fi
    done
}
PYSPY_ON=
[ "${PYSPY:-1}" = 1 ] && PYSPY_ON=1
if [ "${DRY_RUN:-0}" = 1 ]; then  # what would run: the plain server's command and the workflow's jobs
    echo "ceiling server: ${PLAIN[*]}" | tee -a "$OUT/steps.log"
    [ ${#CONFIG_ENV[@]} = 0 ] || echo "ceiling server environment: ${CONFIG_ENV[*]}" | tee -a "$OUT/steps.log"
    IFS=';' read -r -a SWEEP <<< "${CEILING_SWEEP:-}"
    for entry in "${SWEEP[@]}"; do
        split_entry "$entry" "${CEILING_CONCURRENCY:-$CONFIG_IN_FLIGHT}"
        echo "ceiling server: ${PLAIN[*]} ${ENTRY_FLAGS[*]}" | tee -a "$OUT/steps.log"
        server_env=("${CONFIG_ENV[@]}" "${ENTRY_ENV[@]}")
        [ ${#server_env[@]} = 0 ] || echo "ceiling server environment: ${server_env[*]}" | tee -a "$OUT/steps.log"
        echo "ceiling requests in flight: $ENTRY_IN_FLIGHT" | tee -a "$OUT/steps.log"
    done
    snakemake_run "${UNTIL[@]}" -n --quiet rules 2>&1 | tee -a "$OUT/steps.log"
    exit "${PIPESTATUS[0]}"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/steps.log"

snakemake_run --until convert_embedded_target > "$OUT/convert.log" 2>&1
log "target converted rc=$?"

IN_FLIGHT="${CEILING_CONCURRENCY:-$CONFIG_IN_FLIGHT}"
# The ceiling's load on the plain server: client (plain or workflow), requests in flight, the
# environment words, its load-start mark, its output name; then the server's extra flags.
ceiling_load() {
    local client="$1" in_flight="$2" env_words="$3" load_started="$4" name="$5"; shift 5
    "$PY" benchmarks/sglang_regenerate.py ceiling --client "$client" ${STREAM_INTERVAL:+--stream-interval "$STREAM_INTERVAL"} \
        --url http://127.0.0.1:30030 \
        --conversations "results/$RUN/data/conversations.jsonl" --model-path "$MODEL" --config "${CONFIGS[@]}" \
        --prompts "${CEILING_PROMPTS:-2048}" --turns "${CEILING_TURNS:-all}" --concurrency "$in_flight" --server-flags="$*" \
        --server-env="$env_words" --load-started "$load_started" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
# The cores each process keeps busy during a ceiling's load (and, with PYSPY=1, py-spy on each
# SGLang process over the same seconds): its load-start mark, the output.
ceiling_cpu() {
    "$PY" benchmarks/sglang_regenerate.py cpu --wait-for "$1" --after-s "${CEILING_CPU_AFTER_S:-8}" \
        --seconds "${CEILING_CPU_S:-10}" --timeout-s 900 ${PYSPY_ON:+--pyspy-dir "${2%.json}-pyspy"} --out "$2" > /dev/null 2>&1
}
# One plain server per flag set (the config's flags, then each CEILING_SWEEP entry on top).
measure_ceiling() {  # label, requests in flight, environment words (one string), extra flags...
    local label="$1" in_flight="$2" env_words; shift 2
    read -r -a env_words <<< "$1"; shift
    local settings="${env_words[*]}${env_words[*]:+ }$*"  # as the sweep entry spelled them, for the log
    settings="${settings:-the config flags}"
    local load_started="$OUT/ceiling-$label.load-started"  # written by the client as its load starts
    rm -f "$load_started"
    # Another server on the port would answer for this one (a leftover of an earlier run).
    if "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30030/health', timeout=2)" 2> /dev/null; then
        log "port 30030 is taken by a server already running: no ceiling for $label ($settings)"
        return 1
    fi
    # env: the environment for this server alone (the config's, then the entry's over it).
    env "${CONFIG_ENV[@]}" "${env_words[@]}" "${PLAIN[@]}" "$@" > "$OUT/ceiling-server-$label.log" 2>&1 &
    local plain=$!
    local deadline=$((SECONDS + ${SERVER_START_TIMEOUT_S:-600})) up=0
    while [ $SECONDS -lt $deadline ]; do
        "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30030/health', timeout=2)" \
            2> /dev/null && { up=1; break; }
        kill -0 $plain 2>/dev/null || break
        sleep 1
    done
    if [ $up = 0 ]; then  # died or never ready: this flag set has no ceiling, the sweep goes on
        log "plain server not up ($label: $settings): $(tail -n 3 "$OUT/ceiling-server-$label.log" | tr '\n' ' ' | cut -c1-300)"
        kill $plain 2>/dev/null; sleep 3; pkill -9 -f "port 30030" 2>/dev/null; wait $plain 2>/dev/null
        return 1
    fi
    log "plain server up ($label: $settings)"
    if [ "$FREEZE_GC" = 1 ]; then
        "$PY" -c "import sys; from eaglenest.sglang import launch; sys.exit(0 if launch.freeze_gc('http://127.0.0.1:30030') else 1)" \
            && log "plain server $label: garbage collector frozen" || log "plain server $label: not frozen"
    fi
    if [ "${SERVER_METRICS:-1}" = 1 ]; then  # until the server stops (both of its loads, when there are two)
        "$PY" benchmarks/sglang_regenerate.py metrics --url http://127.0.0.1:30030 --every-s 5 \
            --out "$OUT/metrics-ceiling-$label.json" > /dev/null 2>&1 &
    fi
    local profiler=
    if [ "${PROFILE_STEPS:-32}" != 0 ]; then  # SGLang's own profile of some steps under the ceiling's load
        # Counted from the load's start: the client's warm-up request before it may take minutes
        # (flashinfer builds its kernels at first use); the profiler is stopped 30 s after the
        # ceiling in any case.
        "$PY" benchmarks/sglang_regenerate.py profile --url http://127.0.0.1:30030 --wait-for "$load_started" \
            --after-s "${CEILING_PROFILE_AFTER_S:-5}" --steps "${PROFILE_STEPS:-32}" --trace-dir "$OUT/profiles" --timeout-s 900 \
            --out "$OUT/profile-ceiling-$label.json" > /dev/null 2>&1 &
        profiler=$!
    fi
    local sampler=
    if [ "${CEILING_CPU_S:-10}" != 0 ]; then  # which process holds the ceiling back, if one does
        ceiling_cpu "$load_started" "$OUT/cpu-ceiling-$label.json" &
        sampler=$!
    fi
    ceiling_load plain "$in_flight" "${env_words[*]}" "$load_started" "ceiling-$label" "$@"
    log "ceiling $label rc=$? $(tr -d '\n' < "$OUT/ceiling-$label.json" 2>/dev/null | cut -c1-200)"
    if [ -n "$profiler" ]; then  # a ceiling shorter than the wait leaves the profiler no steps: 30 s more at most
        for _ in $(seq 1 30); do kill -0 "$profiler" 2>/dev/null || break; sleep 1; done
        kill "$profiler" 2>/dev/null; wait "$profiler" 2>/dev/null
        log "profile $label: $(tr -d '\n' < "$OUT/profile-ceiling-$label.json" 2>/dev/null | cut -c1-300)"
    fi
    if [ -n "$sampler" ]; then  # a load that failed before it started leaves the sampler nothing to wait for
        [ -e "$load_started" ] || kill "$sampler" 2>/dev/null
        wait "$sampler" 2>/dev/null
        log "cpu $label: $(tr -d '\n' < "$OUT/cpu-ceiling-$label.json" 2>/dev/null | cut -c1-400)"
    fi
    if [ "$label" = 0 ] && [ "${WORKFLOW_CLIENT_CEILING:-1}" = 1 ]; then
        # The same prompts on the same server through the stage's own client (streamed, loop-cut):
        # what the client path costs, apart from the workflow's shards and turn order; once per
        # WORKFLOW_CLIENT_INTERVALS entry (regenerate.stream_interval; "config" = the config's).
        local interval name
        for interval in ${WORKFLOW_CLIENT_INTERVALS:-config}; do
            name=client-workflow
            [ "$interval" = config ] || name="client-workflow-i$interval"
            local client_started="$OUT/$name.load-started"
            ceiling_cpu "$client_started" "$OUT/cpu-$name.json" &
            local client_sampler=$!
            STREAM_INTERVAL="${interval#config}" ceiling_load workflow "$in_flight" "${env_words[*]}" "$client_started" "$name" "$@"
            log "workflow client ($name) on the plain server rc=$? $(tr -d '\n' < "$OUT/$name.json" 2>/dev/null | cut -c1-200)"
            [ -e "$client_started" ] || kill "$client_sampler" 2>/dev/null
            wait "$client_sampler" 2>/dev/null
        done
    fi
    kill $plain 2>/dev/null; sleep 3; pkill -9 -f "port 30030" 2>/dev/null; wait $plain 2>/dev/null
    # The server's own account of its scheduling, read once it has stopped writing its log.
    "$PY" benchmarks/sglang_regenerate.py schedule --log "$OUT/ceiling-server-$label.log" --into "$OUT/ceiling-$label.json" > /dev/null
}
if [ "${CEILING_PROMPTS:-2048}" != 0 ]; then
    measure_ceiling 0 "$IN_FLIGHT" ""
    IFS=';' read -r -a SWEEP <<< "${CEILING_SWEEP:-}"
    label=0
    for entry in "${SWEEP[@]}"; do  # [NAME=VALUE...] FLAGS[@IN_FLIGHT]
        label=$((label + 1))
        split_entry "$entry" "$IN_FLIGHT"
        measure_ceiling "$label" "$ENTRY_IN_FLIGHT" "${ENTRY_ENV[*]}" "${ENTRY_FLAGS[@]}"
    done
    # The fastest is the run's ceiling, and its flags and environment the workflow server's (an overlay).
    "$PY" benchmarks/sglang_regenerate.py pick --ceilings "$OUT"/ceiling-[0-9]*.json --config "${CONFIGS[@]}" \
        --base-concurrency "$IN_FLIGHT" --clients "$OUT"/client-workflow*.json --out "$OUT/ceiling.json" \
        --overlay "$OUT/server-flags.yaml" | tee -a "$OUT/steps.log"
    [ -e "$OUT/server-flags.yaml" ] && CONFIGS+=("$OUT/server-flags.yaml")
fi

if [ "${SERVER_METRICS:-1}" = 1 ]; then  # the workflow's server with the plain servers' --enable-metrics, scraped
    "$PY" - "$OUT/server-metrics.yaml" "${CONFIGS[@]}" <<'PYTHON' && CONFIGS+=("$OUT/server-metrics.yaml")
import sys
from pathlib import Path

import yaml

from eaglenest.node.recon.config import load_config

flags = [str(flag) for flag in load_config(Path.cwd(), sys.argv[2:])["extract"]["sglang"].get("extra_args") or []]
if "--enable-metrics" not in flags:
    flags.append("--enable-metrics")
Path(sys.argv[1]).write_text(yaml.safe_dump({"extract": {"sglang": {"extra_args": flags}}}, sort_keys=False))
PYTHON
    "$PY" benchmarks/sglang_regenerate.py metrics --record "$RECORD" --every-s "${METRICS_EVERY_S:-20}" \
        --out "$OUT/metrics-workflow.json" > /dev/null 2>&1 &
    scraper=$!
fi
"$PY" benchmarks/sglang_regenerate.py watch --record "$RECORD" --out "$OUT/server_ready.txt" &
watcher=$!
profiler=
if [ "${PROFILE_STEPS:-32}" != 0 ]; then  # the workflow's server, the same way, once well into its run
    "$PY" benchmarks/sglang_regenerate.py profile --record "$RECORD" --after-s "${WORKFLOW_PROFILE_AFTER_S:-90}" \
        --steps "${PROFILE_STEPS:-32}" --trace-dir "$OUT/profiles" --out "$OUT/profile-workflow.json" > /dev/null 2>&1 &
    profiler=$!
    if [ "${WORKFLOW_PROFILE_LATE_S:-300}" != 0 ]; then  # and later, when its batch has grown
        "$PY" benchmarks/sglang_regenerate.py profile --record "$RECORD" --after-s "${WORKFLOW_PROFILE_LATE_S:-300}" \
            --steps "${PROFILE_STEPS:-32}" --trace-dir "$OUT/profiles-late" --out "$OUT/profile-workflow-late.json" \
            > /dev/null 2>&1 &
        profiler="$profiler $!"
    fi
fi
sampler=
if [ "${CPU_SAMPLE_S:-60}" != 0 ]; then  # after the profile, which slows the server while it records
    "$PY" benchmarks/sglang_regenerate.py cpu --record "$RECORD" \
        --after-s "${CPU_SAMPLE_AFTER_S:-$(( ${WORKFLOW_PROFILE_AFTER_S:-90} + 30 ))}" \
        --seconds "${CPU_SAMPLE_S:-60}" ${PYSPY_ON:+--pyspy-dir "$OUT/cpu-workflow-pyspy"} --out "$OUT/cpu-workflow.json" \
        > /dev/null 2>&1 &
    sampler=$!
fi
[ -n "${REGENERATE_TIMEOUT_S:-}" ] && LIMIT=(timeout --signal=TERM --kill-after=30 "$REGENERATE_TIMEOUT_S")
# Every process of the workflow's server counts its garbage collections (eaglenest/sglang/gc_stats.py).
[ "${GC_STATS:-1}" != 0 ] && export EAGLENEST_GC_STATS="$OUT/gc"
snakemake_run "${UNTIL[@]}" > "$OUT/regenerate.log" 2>&1
rc=$?
unset EAGLENEST_GC_STATS
log "regenerate rc=$rc"
kill $watcher $profiler $sampler 2>/dev/null
[ -z "${scraper:-}" ] || wait "$scraper" 2>/dev/null  # it ends as the server stops
cp -r "logs/$RUN/sglang/regenerate" "$OUT/server-logs" 2>/dev/null
"$PY" benchmarks/sglang_regenerate.py summary --workdir . --run "$RUN" --ceiling "$OUT/ceiling.json" \
    --ready "$OUT/server_ready.txt" --server-log "$OUT/server-logs/server.log" --cpu "$OUT/cpu-workflow.json" \
    --metrics "$OUT/metrics-workflow.json" --gc-dir "$OUT/gc" --out "$OUT/sglang_regenerate.json" | tee "$OUT/table.md"
# The run's regenerated folder (shards and reports; the input of a drafter trained on the
# target's own answers) beside the results, in parts of at most PART_MIB MiB, for nodes whose
# results leave through channels that cap file sizes. At a checkout's root:
#   cat OUTDIR/regenerated.tar.xz.part-* | tar -xJf -
if [ -d "results/$RUN/regenerated" ]; then
    tar -cf - "results/$RUN/regenerated" | xz -T0 -6 | split -b "${PART_MIB:-15}m" -d - "$OUT/regenerated.tar.xz.part-"
    log "regenerated folder packed: $(ls "$OUT"/regenerated.tar.xz.part-* | wc -l) part(s)"
fi
exit $rc
