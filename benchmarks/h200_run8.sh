#!/usr/bin/env bash
# The eighth real-scale run of docs/results.md on one H200 node (16 CPU cores, 1 GPU): the
# seventh run's data, split, draft vocabulary, references, shape and code path, trained for
# $EPOCHS epochs (default 5) to see where validation accuracy levels off, with a validation
# every half epoch.
#   1. convert the GGUF; prepare, extract and consolidate (--until consolidate).
#   2. train and export (--until export_drafter): the export is what leaves the node first.
#   3. the rest of the workflow: the greedy references and the replay of every prompt at the
#      three settings on the CPU cores, prompts in lockstep (evaluate.replay_batch).
#   EPOCHS=5 bash benchmarks/h200_run8.sh   (logs/h200/: progress.log, times.tsv, one log per
#                                            step, epochs.yaml; EXPORTED, then DONE)
# Expects, carried in: resources/ (the GGUF, eval sets), results/h200-smollm2/data/ (the
# ingested conversations).
source "$(dirname "$0")/h200_steps.sh"
CONFIGS=(config/h200-smollm2.yaml config/h200/carried-data.yaml config/h200/run5.yaml)
EPOCHS=${EPOCHS:-5}
VAL_EVERY=${VAL_EVERY:-385}  # 770 steps an epoch (run 7: 2,310 steps for 3 epochs)
CORES=${CORES:-16}
mkdir -p logs/h200
rm -f logs/h200/EXPORTED logs/h200/DONE
printf 'train:\n  epochs: %s\n  val_every: %s\n' "$EPOCHS" "$VAL_EVERY" >logs/h200/epochs.yaml
RUN=("${CONFIGS[@]}" logs/h200/epochs.yaml)

timed convert $SNAKEMAKE resources/models/SmolLM2-135M-Instruct --cores 4 --configfile "${RUN[@]}" || exit 1
timed data $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until consolidate || exit 1
timed train $SNAKEMAKE --cores "$CORES" --configfile "${RUN[@]}" --until export_drafter || exit 1
touch logs/h200/EXPORTED
timed evaluate $SNAKEMAKE --cores "$CORES" --keep-going --configfile "${RUN[@]}"
touch logs/h200/DONE
