#!/usr/bin/env bash
# WiSE-FT for the released retriever (Wortsman et al. 2022, arXiv:2109.01903): the LoRA weights of a model trained
# further (TUNED: recipes/retrieval.sh's distilled cooldown) and of the point it continued (START: the best
# constant-rate point, the earlier release), averaged with shares ALPHA and 1 - ALPHA (recipes/average_adapters.py;
# the average carries TUNED's training record), scored on the dev suite with texts cut to CURVE_MAX_LENGTH tokens
# beside both, like a curve point (WISE_OUT/summary.json); then, with FINAL=1, recipes/retrieval.sh's final stage
# on the average (recipes/final_stage.sh: the dev suite at full length, the rotation and per-size rows, index kinds,
# RAG, greedy repetition, the generation suites) and its release (releases/RELEASE, replacing the one there).
#   MODEL=gemma3-270m START=runs/gemma3-270m/retriever/adapter \
#     TUNED=runs/gemma3-270m/retriever-kdlm-cooldown/adapter ALPHA=0.5 FINAL=1 bash recipes/wise.sh
# Why: the distilled cooldown lifts the dev suite and costs generation (docs/results.md); the interpolation keeps
# most of the one and gives back part of the other. Decision, not from the paper: one ALPHA, chosen on the dev suite
# and LAMBADA, not a sweep. Every step skips what an earlier sitting finished.
# Environment: MODEL, START, TUNED, ALPHA (0.5), NAME (wise-<ALPHA>), RUNS, WISE_OUT (results/retrieval-<short>-wise),
# OUT (results/retrieval-<short>: the release's rows), DEV, TASKS (dev), CURVE_MAX_LENGTH (256), FINAL (0),
# RAG_QUESTIONS (20), GENERATION (1), GEN_OUT (results/generation-<short>/NAME), RELEASE, RELEASES, START_ROW and
# TUNED_ROW (result folders of START and TUNED at CURVE_MAX_LENGTH, e.g. their curve points; without one that end
# is scored here).
set -euo pipefail
shopt -s inherit_errexit
MODEL=${MODEL:-gemma3-270m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
SHORT=${MODEL%%-*}
: "${START:?START: the adapter the tuned one continued (the best constant-rate point)}"
: "${TUNED:?TUNED: the adapter trained further from START (its distilled cooldown)}"
ALPHA=${ALPHA:-0.5}
NAME=${NAME:-wise-$ALPHA}
WISE_OUT=${WISE_OUT:-results/retrieval-$SHORT-wise}
OUT=${OUT:-results/retrieval-$SHORT}
DEV=${DEV:-results/dev-$SHORT}
TASKS=${TASKS-dev}
CURVE_MAX_LENGTH=${CURVE_MAX_LENGTH:-256}
FINAL=${FINAL:-0}
RAG_QUESTIONS=${RAG_QUESTIONS:-20}
GENERATION=${GENERATION:-1}
GEN_OUT=${GEN_OUT:-results/generation-$SHORT/$NAME}
RELEASE=${RELEASE:-unimae-$MODEL-retriever}
RELEASES=${RELEASES:-releases}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
PYTHON=${PYTHON:-.venv/bin/python}
awk "BEGIN { exit !($ALPHA > 0 && $ALPHA < 1) }" || { echo "wise.sh: ALPHA must lie in (0, 1), not $ALPHA" >&2; exit 2; }

# shellcheck source=recipes/json_field.sh
source "$(dirname "$0")/json_field.sh"
# shellcheck source=recipes/final_stage.sh
source "$(dirname "$0")/final_stage.sh"
MRL_DIMS=${MRL_DIMS:-$(json_field "$TUNED/unimae.json" embedding matryoshka_dims)}  # the sizes it was trained for

wise=$RUNS/$NAME/adapter
[ -f "$wise/adapter_model.safetensors" ] || $PYTHON recipes/average_adapters.py --output "$wise" "$TUNED" "$START" \
  --weights "$ALPHA" "$(awk "BEGIN { print 1 - $ALPHA }")"
if [ -n "$TASKS" ]; then
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$wise" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$WISE_OUT" --label "$NAME" --max-length "$CURVE_MAX_LENGTH"
  labels=("$NAME")
  for end in start tuned; do  # both ends: their rows where given, else scored here alike
    adapter=$START row=${START_ROW:-}
    [ "$end" = start ] || adapter=$TUNED row=${TUNED_ROW:-}
    if [ -n "$row" ]; then
      labels+=("$end=$row")
    else
      # shellcheck disable=SC2086
      $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$adapter" --tasks $TASKS --data-dir "$DATA" \
        --output-dir "$WISE_OUT" --label "$end" --max-length "$CURVE_MAX_LENGTH"
      labels+=("$end")
    fi
  done
  # shellcheck disable=SC2086
  $UNIMAE evaluate summary --output-dir "$WISE_OUT" --tasks $TASKS --name "summary-$NAME" --labels "${labels[@]}"
fi
[ "$FINAL" = 1 ] || exit 0

final_stage "$wise"
dims=()
[ -z "$TASKS" ] || dims=(--summary "$OUT/summary.json" --table "$OUT/dimensions.json" --table "$WISE_OUT/summary-$NAME.json")
tuned_run=$(dirname "$TUNED")
$UNIMAE release --adapter "$wise" --name "$RELEASE" --root "$RELEASES" --dev-results "$OUT/retrieval-eos" \
  "${dims[@]}" --generation "$GEN_OUT/generation.json" \
  --base-generation "results/generation-$SHORT/base-full-scorer/generation.json" --rag "$OUT/rag.json" \
  --repetition "results/generation-$SHORT/greedy-repetition.json" \
  --repetition "results/generation-$SHORT/greedy-repetition-wiki-heldout.json" \
  --train-log "$tuned_run/log.jsonl" \
  --command "MODEL=$MODEL START=$START TUNED=$TUNED ALPHA=$ALPHA FINAL=1 bash recipes/wise.sh"
