#!/usr/bin/env bash
# WiSE-FT for the released retriever (Wortsman et al. 2022, arXiv:2109.01903): the LoRA weights of a model trained
# further (TUNED: recipes/retrieval.sh's distilled cooldown) and of the point it continued (START: the best
# constant-rate point, the earlier release), averaged with shares ALPHA and 1 - ALPHA (recipes/average_adapters.py;
# the average carries TUNED's training record) into RUNS/NAME/adapter in bf16 (the release's own weights) and
# RUNS/NAME/adapter-fp32 (the bf16 check), both scored on the dev suite with texts cut to CURVE_MAX_LENGTH tokens
# beside both ends, like a curve point (WISE_OUT/summary-NAME.json); then, with FINAL=1, recipes/retrieval.sh's
# final stage on the bf16 average into OUT (recipes/final_stage.sh: the dev suite at full length, the rotation and
# per-size rows, index kinds, RAG, greedy repetition, the generation suites) and its release (releases/RELEASE,
# replacing the one there).
#   MODEL=gemma3-270m START=runs/gemma3-270m/retriever/adapter \
#     TUNED=runs/gemma3-270m/retriever-kdlm-cooldown/adapter ALPHA=0.5 FINAL=1 bash recipes/wise.sh
# Why: the distilled cooldown lifts the dev suite and costs generation (docs/results.md); the interpolation keeps
# most of the one and gives back part of the other. Decision, not from the paper: one ALPHA, chosen on the dev suite
# and LAMBADA, not a sweep. Every step skips what an earlier sitting finished.
# Environment: MODEL, START, TUNED, ALPHA (0.5), NAME (wise-<ALPHA>), RUNS, WISE_OUT (results/retrieval-<short>-wise),
# OUT (WISE_OUT: the release's rows stay where they are), DEV, TASKS (dev), CURVE_MAX_LENGTH (256), FINAL (0),
# RAG_QUESTIONS (20), GENERATION (1), GEN_OUT (results/generation-<short>/NAME), RELEASE, RELEASES, START_ROW and
# TUNED_ROW (result folders of START and TUNED at CURVE_MAX_LENGTH, e.g. their curve points; without one that end
# is scored here), TUNED_COMMAND (the command that trained TUNED, which the release card's command starts with).
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
OUT=${OUT:-$WISE_OUT}
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

wise=$RUNS/$NAME/adapter  # bf16: the release's own weights, so every result below is the release's
for dtype in bfloat16 float32; do  # the fp32 average beside it: what bf16 storage is checked against
  folder=$wise
  [ "$dtype" = bfloat16 ] || folder=$wise-fp32
  [ -f "$folder/adapter_model.safetensors" ] || $PYTHON recipes/average_adapters.py --output "$folder" "$TUNED" \
    "$START" --weights "$ALPHA" "$(awk "BEGIN { print 1 - $ALPHA }")" --dtype "$dtype"
done
if [ -n "$TASKS" ]; then
  for pair in "$wise:$NAME" "$wise-fp32:$NAME-fp32"; do
    # shellcheck disable=SC2086  # TASKS is a word list on purpose
    $UNIMAE evaluate embeddings --model "$MODEL" --adapter "${pair%%:*}" --tasks $TASKS --data-dir "$DATA" \
      --output-dir "$WISE_OUT" --label "${pair##*:}" --max-length "$CURVE_MAX_LENGTH"
  done
  labels=("$NAME" "$NAME-fp32")
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

REPETITION_LABEL=$NAME final_stage "$wise"  # the release's repetition rows stay theirs
dims=()
[ -z "$TASKS" ] || dims=(--summary "$OUT/summary.json" --table "$OUT/dimensions.json" --table "$WISE_OUT/summary-$NAME.json")
tuned_run=$(dirname "$TUNED")
$UNIMAE release --adapter "$wise" --name "$RELEASE" --root "$RELEASES" --dev-results "$OUT/retrieval-eos" \
  "${dims[@]}" --generation "$GEN_OUT/generation.json" \
  --base-generation "results/generation-$SHORT/base-full-scorer/generation.json" --rag "$OUT/rag.json" \
  --repetition "results/generation-$SHORT/greedy-repetition.json" \
  --repetition "results/generation-$SHORT/greedy-repetition-wiki-heldout.json" \
  --train-log "$tuned_run/log.jsonl" \
  --command "${TUNED_COMMAND:+$TUNED_COMMAND && }MODEL=$MODEL START=$START TUNED=$TUNED ALPHA=$ALPHA NAME=$NAME FINAL=1 bash recipes/wise.sh"
