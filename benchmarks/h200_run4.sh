#!/usr/bin/env bash
# The fourth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU):
#   1. training throughput: eaglenest's step against the plain eager ceiling (Kimi and SmolLM2
#      shapes), the flex/dense check, and the code before this run on the same shapes;
#   2. the full set of config/h200-smollm2.yaml with the TTT position fix: (a) one epoch with
#      run 3's settings (the before/after of the fix alone) and (b) EPOCHS epochs, side by side
#      on the GPU, each evaluated by replay on every prompt (config/h200/run4.yaml);
#   3. benchmarks/sglang_h200.sh on (a)'s export beside (b)'s training.
#   bash benchmarks/h200_run4.sh    (writes logs/h200/: progress.log, times.tsv, one log per
#                                    step, bench/*.json, sglang/, and DONE at the end)
# Expects, carried in: resources/ (the GGUF, eval sets) and results/h200-smollm2/data/ (the
# ingested conversations); optionally .bench-old/ (the code before this run,
# for the throughput comparison) and the SGLang wheel archives in $SGLANG_WHEELS, which may
# arrive while the run is under way (it waits for $SGLANG_WHEELS/READY).
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run4.yaml)
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-420} # wall seconds (b) may train, side by side with (a)
EPOCHS=${EPOCHS:-}                     # empty: sized from the measured throughput
RUNS=${RUNS-one-epoch long}            # RUNS=long: the multi-epoch run alone
BENCHMARKS=${BENCHMARKS:-1}            # 0: straight to the data half
LONG_RUN=h200-smollm2-long
SGLANG_WHEELS=${SGLANG_WHEELS:-.sglang-wheels}
BENCH=logs/h200/bench
mkdir -p logs/h200 $BENCH
rm -f logs/h200/DONE


# --- CPU: the target's conversion, then prepare and the greedy references (float32, one core
# a chunk), all beside the GPU benchmarks ----------------------------------------------------
prep() {
  timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${CONFIGS[@]}" &&
    timed prepare-and-references $SNAKEMAKE --cores 12 --keep-going --configfile "${CONFIGS[@]}" \
      --until prepare evaluate_reference
}
prep &
PREP=$!

# --- GPU: training throughput, one shape at a time -------------------------------------------
BENCH_DEADLINE=$((SECONDS + ${BENCH_BUDGET_S:-450})) # the benchmarks never hold the GPU longer
bench() { # name, arguments of train_throughput.py
  local name=$1 left=$((BENCH_DEADLINE - SECONDS))
  shift
  if [ $left -lt 30 ]; then
    echo "$(stamp) skip bench-$name (benchmark time used up)" >>logs/h200/progress.log
    return 0
  fi
  timed "bench-$name" timeout $((left < 240 ? left : 240)) python3 "$@" --out "$BENCH/$name.json"
}
NEW=benchmarks/train_throughput.py
OLD=${OLD_BENCH:-.bench-old/benchmarks/train_throughput.py}
[ "$BENCHMARKS" = 1 ] || BENCH_DEADLINE=0
bench train_throughput_h200_smollm2 $NEW --shape smollm2 --rows 8 --token-budget 4096 --sample-len 4096 \
  --steps 8 --warmup 3 --ceiling --check
[ -f "$OLD" ] && bench train_throughput_h200_smollm2_before "$OLD" --shape smollm2 --rows 8 \
  --token-budget 4096 --sample-len 4096 --steps 6 --warmup 3
bench train_throughput_h200_kimi $NEW --shape kimi --rows 1 --token-budget 4096 --sample-len 4096 \
  --steps 8 --warmup 3 --ceiling
bench train_throughput_h200_kimi_8x4096 $NEW --shape kimi --rows 8 --token-budget 4096 --sample-len 4096 \
  --steps 5 --warmup 2
[ "${BENCH_COMPILE:-1}" = 1 ] && bench train_throughput_h200_smollm2_compile $NEW --shape smollm2 --rows 8 \
  --token-budget 4096 --sample-len 4096 --steps 8 --warmup 3 --compile

wait $PREP || echo "$(stamp) prep had a failure (see its logs); going on" >>logs/h200/progress.log

# --- the data half once, for both runs -------------------------------------------------------
timed extract $SNAKEMAKE --cores 14 --configfile "${CONFIGS[@]}" --until consolidate || exit 1

if [ -z "$EPOCHS" ]; then
  # One epoch is ~21.2M tokens; two trainings share the GPU at 8 rows of 2,048 (not 4,096),
  # so count a little over half of the benchmark's tokens/s.
  EPOCHS=$(python3 - "$TRAIN_BUDGET_S" <<'PY'
import json, sys
runs = json.load(open("logs/h200/bench/train_throughput_h200_smollm2.json"))["runs"]
tps = next(r["tokens_per_s"] for r in runs if "tokens_per_s" in r and "step" not in r)
print(max(2, min(10, int(float(sys.argv[1]) * tps * 0.55 / 21.2e6))))
PY
  ) || EPOCHS=3
fi
echo "$(stamp) epochs for $LONG_RUN: $EPOCHS" >>logs/h200/progress.log
cat >/tmp/long.yaml <<EOF
run: $LONG_RUN
train:
  epochs: $EPOCHS
EOF
# The trainings use FlexAttention unless the benchmark's check found it wrong or failing there.
# Their data loaders want their cores: train.threads is 2 in run4.yaml, and (a)'s reference
# and replay jobs share the node, so (b) alone trains fastest (RUNS=long).
BENCHMARKS=$BENCHMARKS python3 - <<'PY' >/tmp/attention.yaml
import json, os
try:
    check = json.load(open("logs/h200/bench/train_throughput_h200_smollm2.json"))["backend_check"]
    ok = check.get("max_rel_err", 1.0) < 1e-3
except (OSError, KeyError, ValueError):
    ok = os.environ["BENCHMARKS"] == "0"  # no check ran: the flex path as tested before
print("train:\n  attention: " + ("auto" if ok else "dense"))
PY
echo "$(stamp) $(tr '\n' ' ' </tmp/attention.yaml)" >>logs/h200/progress.log
# (b) reads the same files: hard links, same bytes and times, no extra disk.
mkdir -p "results/$LONG_RUN"
for part in data prepared hidden consolidated evaluate; do
  cp -al "results/h200-smollm2/$part" "results/$LONG_RUN/$part"
done
rm -rf "results/$LONG_RUN/evaluate/"*/steps*
# Same bytes and times as (a)'s, so nothing before training is planned for (b): the dry run
# in the log shows it.
timed plan-long $SNAKEMAKE -n --nolock --cores 1 --configfile "${CONFIGS[@]}" /tmp/long.yaml
if grep -qE "^(extract_hidden_states|consolidate|prepare|ingest) " logs/h200/plan-long.log; then
  timed touch-long $SNAKEMAKE --touch --nolock --cores 1 --configfile "${CONFIGS[@]}" /tmp/long.yaml \
    --until consolidate evaluate_reference
fi

# Both evaluate every drafting setting: the references' lookahead (a param) follows the deepest
# setting, so a run with fewer settings would decode them again.
ONE=
case " $RUNS " in *" one-epoch "*)
  timed one-epoch $SNAKEMAKE --cores 10 --configfile "${CONFIGS[@]}" /tmp/attention.yaml &
  ONE=$! ;;
esac
case " $RUNS " in *" long "*)
  timed long $SNAKEMAKE --cores 14 --nolock --configfile "${CONFIGS[@]}" /tmp/attention.yaml /tmp/long.yaml & ;;
esac

if [ "${SGLANG:-1}" = 1 ]; then
  (
    while [ ! -f results/h200-smollm2/export/sglang/config.json ] || [ ! -f "$SGLANG_WHEELS/READY" ]; do
      [ -n "$ONE" ] && kill -0 $ONE 2>/dev/null || exit 0
      sleep 10
    done
    shard=$(ls results/h200-smollm2/prepared/*/shard-00000.safetensors | head -1)
    SITE=${SGLANG_SITE:-/tmp/sglang-site} SGLANG_WHEELS=$SGLANG_WHEELS TARGET_DIR=resources/models/SmolLM2-135M-Instruct PREPARED_SHARD=$shard \
      DRAFTER_EXPORT=results/h200-smollm2/export/sglang EVAL_PROMPTS=resources/eval/mt_bench_question.jsonl \
      MEM_FRACTION=0.25 TIME_LIMIT_S=${SGLANG_LIMIT_S:-540} timed sglang bash benchmarks/sglang_h200.sh logs/h200/sglang
  ) &
fi

wait
touch logs/h200/DONE
