#!/usr/bin/env bash
# The paper's Fig. 3a: UniMAE trained with p_mar in {0, 0.2, 0.4, 0.5, 0.6, 0.8}, dev-suite average vs p_mar.
#   MODEL=smollm2-135m bash recipes/ablation_pmar.sh      (about 6 x 45 min on 2 CPU cores)
# Environment: STEPS (training steps per point; default: the recipe's), TASKS (default "dev"; a
# space-separated task list for a cheaper run), P_MARS (the grid), RUNS, OUT, TRAIN_FLAGS (extra
# `unimae train` flags for every point, e.g. "--batch-size 8 --max-length 64").
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL-pmar}
OUT=${OUT:-results/ablation-pmar-$MODEL}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"
TASKS=${TASKS:-dev}
P_MARS=${P_MARS:-0 0.2 0.4 0.5 0.6 0.8}
TRAIN_FLAGS=${TRAIN_FLAGS:-}
steps=()
if [ -n "${STEPS:-}" ]; then steps=(--steps "$STEPS"); fi
labels=()
for p in $P_MARS; do
  # shellcheck disable=SC2086  # TRAIN_FLAGS is a word list on purpose
  train_run "$RUNS/p$p" --model "$MODEL" $TRAIN_FLAGS --p-mar "$p" "${steps[@]}"  # resumes an interrupted point
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$RUNS/p$p/adapter" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$OUT" --label "p_mar=$p"
  labels+=("p_mar=$p")
done
# shellcheck disable=SC2086
$UNIMAE evaluate summary --output-dir "$OUT" --labels "${labels[@]}" --tasks $TASKS
${PYTHON:-.venv/bin/python} recipes/plot_ablation.py "$OUT/summary.json" "$OUT/pmar.png"
