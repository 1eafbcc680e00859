#!/usr/bin/env bash
# Small experiments that choose the supervised stage's recipe before its long run (recipes/retrieval.sh):
# the unsupervised start (UniMAE or none), query/document prompts, Matryoshka training and the temperature.
# Each variant is the supervised stage on a small budget, STEPS steps of BATCH pairs (default 24 x 64: 1,536
# pairs, about 1% of the pairs; the same batches for every variant, same seed), then the 9-task dev suite with
# texts cut to EVAL_MAX_LENGTH tokens (default 256, which only shortens SciFact's abstracts: the official
# suite uses 512). Rows: OUT/summary.json (`unimae evaluate summary`), labels as below.
#   MODEL=smollm2-135m bash recipes/retrieval_choices.sh
# Variants (VARIANTS, in this order by default; each resumes / is skipped once done):
#   plain       UniMAE start, no prompts, no Matryoshka, temperature 0.05 (the old recipe's stage)
#   prompts     + the query prompt on asymmetric sources (QUERY_PROMPT; SYMMETRIC sources take none)
#   prompts-mrl + Matryoshka dimensions (MRL_DIMS)
#   mrl         Matryoshka dimensions without the prompts (with `prompts`, separates the two changes)
#   base-start  prompts-mrl without the UniMAE stage (the supervised LoRA on the base model)
#   t0.02       prompts-mrl at temperature 0.02
#   prompts-drop  prompts with --query-prompt-dropout 0.5 (half the asymmetric queries trained unprompted)
# Environment: MODEL, RUNS, OUT, PAIRS (the wiki inverse-cloze pairs; built if absent), STEPS, BATCH, CHUNK,
# EVAL_MAX_LENGTH, VARIANTS (the summary keeps every variant scored so far), UNIMAE_RUN / UNIMAE_FLAGS (the start, shared with recipes/retrieval.sh).
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
SHORT=${MODEL%%-*}
OUT=${OUT:-results/retrieval-choices-$SHORT}
PAIRS=${PAIRS:-../data-pairs}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
PYTHON=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-24}
BATCH=${BATCH:-64}
CHUNK=${CHUNK:-32}
EVAL_MAX_LENGTH=${EVAL_MAX_LENGTH:-256}
VARIANTS=${VARIANTS:-plain prompts prompts-mrl base-start t0.02}
UNIMAE_RUN=${UNIMAE_RUN:-unimae}
UNIMAE_FLAGS=${UNIMAE_FLAGS:-}
# shellcheck source=recipes/retrieval_data.sh
source "$(dirname "$0")/retrieval_data.sh"  # $files, $QUERY_PROMPT, $SYMMETRIC, $MRL_DIMS
# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"

prompt_flags=(--query-prompt "$QUERY_PROMPT" --symmetric-sources "$SYMMETRIC")
mrl_flags=(--matryoshka-dims "$MRL_DIMS")
for variant in $VARIANTS; do
  init=(--init-adapter "$RUNS/$UNIMAE_RUN/adapter")
  case $variant in
    plain) flags=() ;;
    prompts) flags=("${prompt_flags[@]}") ;;
    prompts-mrl) flags=("${prompt_flags[@]}" "${mrl_flags[@]}") ;;
    mrl) flags=("${mrl_flags[@]}") ;;
    base-start) flags=("${prompt_flags[@]}" "${mrl_flags[@]}"); init=() ;;
    t0.02) flags=("${prompt_flags[@]}" "${mrl_flags[@]}" --temperature 0.02) ;;
    prompts-drop) flags=("${prompt_flags[@]}" --query-prompt-dropout 0.5) ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  if [ ${#init[@]} -gt 0 ]; then
    # shellcheck disable=SC2086  # UNIMAE_FLAGS is a word list on purpose
    train_run "$RUNS/$UNIMAE_RUN" --model "$MODEL" --method unimae $UNIMAE_FLAGS
  fi
  train_run "$RUNS/choices/$variant" --model "$MODEL" --method contrastive "${init[@]}" --data "$files" \
    --data-weights sqrt --steps "$STEPS" --batch-size "$BATCH" --micro-batch-size "$BATCH" \
    --grad-cache-chunk "$CHUNK" --max-length 128 --save-every 5 "${flags[@]}"
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$RUNS/choices/$variant/adapter" --tasks dev \
    --data-dir "$DATA" --output-dir "$OUT" --label "$variant" --max-length "$EVAL_MAX_LENGTH"
done
done_labels=()  # every variant scored so far, in this order (a later sitting's VARIANTS adds rows, drops none)
for variant in plain prompts prompts-mrl mrl base-start t0.02 prompts-drop; do
  [ -f "$OUT/$variant/run.json" ] && done_labels+=("$variant")
done
$UNIMAE evaluate summary --output-dir "$OUT" --tasks dev --name summary --labels "${done_labels[@]}"
