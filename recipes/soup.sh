#!/usr/bin/env bash
# Checkpoint averaging of the released retriever's run (recipes/average_adapters.py): the mean of the LoRA weights
# of the run's adapters at the points INGREDIENTS names, scored on the dev suite with texts cut to
# CURVE_MAX_LENGTH tokens beside the best single point (BASE), both with the current code, into OUT/soup.
#   MODEL=smollm2-135m bash recipes/soup.sh
# Environment: MODEL, RUNS, OUT, BASE (the best point's adapter folder), INGREDIENTS (adapter folders, space-
# separated), LABEL, CURVE_MAX_LENGTH (256). OUT/curve's embedding cache is copied into OUT/soup once, so BASE's
# unchanged texts are not embedded again (the cache is keyed by adapter revision, length and text).
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
SHORT=${MODEL%%-*}
OUT=${OUT:-results/retrieval-$SHORT}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
PYTHON=${PYTHON:-.venv/bin/python}
BASE=${BASE:-$RUNS/retriever/adapter}
INGREDIENTS=${INGREDIENTS:-$RUNS/retriever/adapter $RUNS/retriever/adapter-step-240 $RUNS/retriever-cooldown/adapter}
LABEL=${LABEL:-soup-200-240-cooldown-240}
CURVE_MAX_LENGTH=${CURVE_MAX_LENGTH:-256}
# shellcheck source=recipes/json_field.sh
source "$(dirname "$0")/json_field.sh"
soup=$RUNS/soup-$LABEL
mkdir -p "$OUT/soup"
[ -f "$OUT/soup/embedding_cache.sqlite" ] || cp "$OUT/curve/embedding_cache.sqlite" "$OUT/soup/"
# shellcheck disable=SC2086  # INGREDIENTS is a word list on purpose
[ -f "$soup/adapter_model.safetensors" ] || $PYTHON recipes/average_adapters.py --output "$soup" $INGREDIENTS
base_steps=$(json_field "$BASE/unimae.json" trained_steps)
for pair in "$BASE:step-$base_steps" "$soup:$LABEL"; do
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "${pair%%:*}" --tasks dev --data-dir "$DATA" \
    --output-dir "$OUT/soup" --label "${pair##*:}" --max-length "$CURVE_MAX_LENGTH"
done
$UNIMAE evaluate summary --output-dir "$OUT/soup" --tasks dev --name summary --labels "step-$base_steps" "$LABEL"
