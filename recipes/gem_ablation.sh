#!/usr/bin/env bash
# GEM's ablation of k, the number of summary tokens (paper: k = 1 / 2 / 5 / 10 -> 54.35 / 54.67 / 55.88 / 56.12
# on its MTEB subset), on the dev suite, with the paper's recipe (`--method gem` defaults, METHOD.md section 2).
# k = 1 is the paper's default, so its row (label k=1) is also GEM's Table 1 row (`gem-summary`).
# Results: OUT/summary.json (labels k=<n>, every k scored into OUT), written by `unimae evaluate summary`, and
# its plot OUT/k.png.
#   MODEL=smollm2-135m bash recipes/gem_ablation.sh                 (k = 1, 2, 5, 10)
#   MODEL=gemma3-270m K_VALUES=1 bash recipes/gem_ablation.sh       (GEM's row for the second model)
# Budget: the paper's 1,000 steps of 32 rows (100 NTP steps at lr 1e-4, then 900 contrastive at 1e-5, cosine),
# one micro-batch of 32 so each text has the paper's 31 in-batch negatives. The paper trains on single Wikipedia
# sentences (SimCSE's), where its max length 512 never binds; we train on shared/data's Wikipedia paragraphs cut
# to 64 tokens, about a sentence's worth. On 2 CPU cores that is several hours per run: STEPS / BATCH / MICRO /
# MAX_LENGTH make a cheaper run (state the budget with the results).
# Environment: MODEL, K_VALUES (the grid), STEPS, SWITCH (NTP steps), BATCH, MICRO, MAX_LENGTH, TRAIN_DATA,
# TASKS (default "dev"; a space-separated task list for a cheaper run), RUNS, OUT, TRAIN_FLAGS (extra
# `unimae train` flags for every run, e.g. "--gem-summary-tokens spare" or "--gem-prefix-dropout 0.1").
# Resumable (recipes/train_run.sh): a finished run is not retrained, an interrupted one continues from its last
# checkpoint, and finished tasks are not evaluated again.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
TRAIN_DATA=${TRAIN_DATA:-$DATA/pretrain/wikipedia_paragraphs.jsonl}
RUNS=${RUNS:-runs/$MODEL-gem}
OUT=${OUT:-results/ablation-gem-k-$MODEL}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"
TASKS=${TASKS:-dev}
K_VALUES=${K_VALUES:-1 2 5 10}
STEPS=${STEPS:-1000}
SWITCH=${SWITCH:-100}
BATCH=${BATCH:-32}
MICRO=${MICRO:-32}
MAX_LENGTH=${MAX_LENGTH:-64}
TRAIN_FLAGS=${TRAIN_FLAGS:-}
for k in $K_VALUES; do
  run="$RUNS/k$k"
  # shellcheck disable=SC2086  # TRAIN_FLAGS is a word list on purpose
  train_run "$run" --model "$MODEL" --method gem --data "$TRAIN_DATA" --num-summary-tokens "$k" --steps "$STEPS" \
    --gem-switch-step "$SWITCH" --batch-size "$BATCH" --micro-batch-size "$MICRO" --max-length "$MAX_LENGTH" \
    $TRAIN_FLAGS
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$run/adapter" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$OUT" --label "k=$k"
done
# The summary has every k scored into OUT so far, so a grid run in parts (K_VALUES="2 5") still gets one table.
mapfile -t labels < <(find "$OUT" -maxdepth 1 -name 'k=*' -type d -printf '%f\n' | sort -t= -k2 -n)
# shellcheck disable=SC2086
$UNIMAE evaluate summary --output-dir "$OUT" --labels "${labels[@]}" --tasks $TASKS --name summary
${PYTHON:-.venv/bin/python} recipes/plot_ablation.py "$OUT/summary.json" "$OUT/k.png" --parameter k --log-x
