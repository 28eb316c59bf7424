#!/usr/bin/env bash
# Runs one recorded real-scale run (docs/results.md) on one GPU node from its config overlay:
# the target's conversion, the data phase (prepare, extract, consolidate), training and the
# export, then the rest of the workflow (the greedy references and the replay); optional
# training-step benchmarks beside the data phase and the SGLang benchmark after the export.
#   bash benchmarks/run.sh config/h200/run10.yaml                 # the tenth run
#   bash benchmarks/run.sh --carried-data --no-evaluate config/h200/run10.yaml
#   bash benchmarks/run.sh --bench "kimi compile" config/h200/run10.yaml
# Options:
#   --base FILE       the config the overlays apply to (default config/h200-smollm2.yaml)
#   --carried-data    add config/h200/carried-data.yaml: results/<run>/data/ was brought in
#                     instead of the ShareGPT file
#   --epochs N        override train.epochs (written to logs/h200/override.yaml)
#   --bench PARTS     benchmarks/h200_train_steps.sh parts (e.g. "kimi compile", "smollm2")
#                     beside the data phase, JSONs in logs/h200/bench/; training waits for
#                     them (at most BENCH_WAIT_S, default 420 s)
#   --sglang          after the export: benchmarks/sglang_h200.sh on it (SGLANG_WHEELS,
#                     SGLANG_SITE as that script reads them), in logs/h200/sglang/
#   --no-evaluate     stop after the export (evaluate elsewhere from the export)
#   --cores N         Snakemake's cores (default: all of the node's)
# Writes logs/h200/: progress.log (each step's start and end), times.tsv (name, wall seconds,
# exit status), one log per step, config.txt (the config files used), EXPORTED once the export
# is written, DATA_DONE after the data phase, DONE at the end.
source "$(dirname "$0")/h200_steps.sh"
BASE=config/h200-smollm2.yaml
EXTRA=()
OVERLAYS=()
BENCH_PARTS=
SGLANG=0
EVALUATE=1
EPOCHS=
CORES=$(nproc)
while [ $# -gt 0 ]; do
  case $1 in
  --base) BASE=$2; shift 2 ;;
  --carried-data) EXTRA+=(config/h200/carried-data.yaml); shift ;;
  --epochs) EPOCHS=$2; shift 2 ;;
  --bench) BENCH_PARTS=$2; shift 2 ;;
  --sglang) SGLANG=1; shift ;;
  --no-evaluate) EVALUATE=0; shift ;;
  --cores) CORES=$2; shift 2 ;;
  -h | --help) sed -n '2,/^source/p' "$0" | sed '$d'; exit 0 ;;
  -*) echo "unknown option $1 (--help lists them)" >&2; exit 2 ;;
  *) OVERLAYS+=("$1"); shift ;;
  esac
done
[ ${#OVERLAYS[@]} -gt 0 ] || { echo "name the run's overlay, e.g. config/h200/run10.yaml" >&2; exit 2; }
RUN=("$BASE" "${EXTRA[@]}" "${OVERLAYS[@]}")
if [ -n "$EPOCHS" ]; then
  printf 'train:\n  epochs: %s\n' "$EPOCHS" >logs/h200/override.yaml
  RUN+=(logs/h200/override.yaml)
fi
for f in "${RUN[@]}"; do [ -f "$f" ] || { echo "no config file $f" >&2; exit 2; }; done
BENCH=logs/h200/bench
mkdir -p $BENCH
rm -f logs/h200/DATA_DONE logs/h200/EXPORTED logs/h200/DONE logs/h200/BENCH_DONE
echo "${RUN[*]}" >logs/h200/config.txt
echo "$(stamp) configs: ${RUN[*]}" >>logs/h200/progress.log
RUN_DIR=results/$(setting - run "${RUN[@]}")
TARGET_DIR=$(setting target path "${RUN[@]}")
# A warm start (train.init_from) needs its drafter before anything runs; WARM_START_WAIT_S
# (default 0) waits that long for one that arrives (moved into place whole) after the start.
init_from=$(setting train init_from "${RUN[@]}")
if [ -n "$init_from" ] && [ ! -e "$init_from" ] && ! wait_for "$init_from" "${WARM_START_WAIT_S:-0}"; then
  echo "$(stamp) no warm-start drafter in $init_from (train.init_from)" | tee -a logs/h200/progress.log >&2
  exit 1
fi

if [ -n "$BENCH_PARTS" ]; then
  ( # the benchmarks' random targets and shards stay in memory, off the disk the run's states fill
    export TMPDIR=/dev/shm
    PART=$BENCH_PARTS DEST=$BENCH bash benchmarks/h200_train_steps.sh
    touch logs/h200/BENCH_DONE
  ) &
fi

# --cores before the target: a SNAKEMAKE ending in a many-valued option (--rerun-triggers mtime) would take the target as one more value
timed convert $SNAKEMAKE --cores 4 "$TARGET_DIR" --configfile "${RUN[@]}" || exit 1
timed data $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until consolidate || exit 1
touch logs/h200/DATA_DONE  # benchmarks/train_beside.sh starts a second drafter on this data
if [ -n "$BENCH_PARTS" ]; then
  wait_for logs/h200/BENCH_DONE "${BENCH_WAIT_S:-420}" ||
    echo "$(stamp) the benchmarks still run; training starts" >>logs/h200/progress.log
fi
timed train $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until export_drafter || exit 1
touch logs/h200/EXPORTED
# What an evaluation elsewhere needs beside the export: the shards' checksums and the split.
cp "$RUN_DIR/consolidated/index.json" "$RUN_DIR/consolidated/split.json" logs/h200/ 2>/dev/null

if [ "$SGLANG" = 1 ]; then
  shard=$(ls "$RUN_DIR"/prepared/*/shard-00000.safetensors | head -1)
  SITE=${SGLANG_SITE:-/tmp/sglang-site} SGLANG_WHEELS=${SGLANG_WHEELS:-.sglang-wheels} \
    TARGET_DIR=$TARGET_DIR PREPARED_SHARD=$shard DRAFTER_EXPORT=$RUN_DIR/export/sglang \
    EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl MEM_FRACTION=${MEM_FRACTION:-0.25} \
    TIME_LIMIT_S=${SGLANG_LIMIT_S:-600} timed sglang bash benchmarks/sglang_h200.sh logs/h200/sglang &
fi
[ "$EVALUATE" = 1 ] && timed evaluate $SNAKEMAKE --cores "$CORES" --keep-going --configfile "${RUN[@]}"
wait
touch logs/h200/DONE
