#!/usr/bin/env bash
# Small experiments that choose the supervised stage's recipe before its long run (recipes/retrieval.sh):
# the unsupervised start (UniMAE, GEM or none), query/document prompts, Matryoshka training and the temperature.
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
#   seed1       prompts-mrl with --seed 1 (other batches, another LoRA init: how far a reseed moves a row)
#   gem-start   prompts-mrl from a GEM stage instead of UniMAE's (trained into RUNS/GEM_RUN: k = 1 summary token,
#               GEM_STEPS steps of 32 Wikipedia paragraphs cut to 64 tokens, GEM_SWITCH of them NTP; the
#               `k=1` row of recipes/gem_ablation.sh at STEPS=300 SWITCH=100), merged into the base like the others
#   hn          prompts-mrl on the same batches, each pair with a hard negative mined by the model's released
#               retriever (MINER, `unimae mine`: the source's positives as candidates, a seeded pool of MINE_POOL
#               of them plus the run's own, eq. (1)'s 5% margin, the hardest survivor; only the pairs the STEPS
#               batches draw) unless its source gave one
#   len256      prompts-mrl with training texts cut to 256 tokens instead of 128 (the dev suite embeds up to 512)
#   mean, wmean prompts-mrl embedding with --pooling mean (the states' mean) or wmean (SGPT's position-weighted
#               mean) instead of the UniMAE stage's h_eos; scored into OUT/<variant> but left out of the summary
#               (docs/results.md compares them with prompts-mrl rescored after the whitespace rule)
# Environment: MODEL, RUNS, OUT, PAIRS (the wiki inverse-cloze pairs; built if absent), STEPS, BATCH, CHUNK,
# EVAL_MAX_LENGTH, VARIANTS (the summary keeps every variant scored so far), UNIMAE_RUN / UNIMAE_FLAGS (the start, shared with recipes/retrieval.sh),
# GEM_RUN / GEM_STEPS / GEM_SWITCH (gem-start's GEM stage), MINER / MINE_POOL (hn's miner and candidate pool).
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
GEM_RUN=${GEM_RUN:-gem-start}
GEM_STEPS=${GEM_STEPS:-300}
GEM_SWITCH=${GEM_SWITCH:-100}
MINER=${MINER:-unimae-$MODEL-retriever}
MINE_POOL=${MINE_POOL:-2048}
# shellcheck source=recipes/retrieval_data.sh
source "$(dirname "$0")/retrieval_data.sh"  # $files, $QUERY_PROMPT, $SYMMETRIC, $MRL_DIMS
# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"

prompt_flags=(--query-prompt "$QUERY_PROMPT" --symmetric-sources "$SYMMETRIC")
mrl_flags=(--matryoshka-dims "$MRL_DIMS")
for variant in $VARIANTS; do
  init=(--init-adapter "$RUNS/$UNIMAE_RUN/adapter")
  data=$files
  case $variant in
    plain) flags=() ;;
    prompts) flags=("${prompt_flags[@]}") ;;
    prompts-mrl) flags=("${prompt_flags[@]}" "${mrl_flags[@]}") ;;
    mrl) flags=("${mrl_flags[@]}") ;;
    base-start) flags=("${prompt_flags[@]}" "${mrl_flags[@]}"); init=() ;;
    t0.02) flags=("${prompt_flags[@]}" "${mrl_flags[@]}" --temperature 0.02) ;;
    prompts-drop) flags=("${prompt_flags[@]}" --query-prompt-dropout 0.5) ;;
    seed1) flags=("${prompt_flags[@]}" "${mrl_flags[@]}" --seed 1) ;;
    len256) flags=("${prompt_flags[@]}" "${mrl_flags[@]}" --max-length 256) ;;  # the later flag wins
    mean | wmean) flags=("${prompt_flags[@]}" "${mrl_flags[@]}" --pooling "$variant") ;;
    gem-start) flags=("${prompt_flags[@]}" "${mrl_flags[@]}"); init=(--init-adapter "$RUNS/$GEM_RUN/adapter") ;;
    hn) flags=("${prompt_flags[@]}" "${mrl_flags[@]}")
      mined=$PAIRS/mined-$SHORT-choices
      $UNIMAE mine --model "$MODEL" --adapter "$MINER" --data "$files" --symmetric-sources "$SYMMETRIC" \
        --steps "$STEPS" --train-batch-size "$BATCH" --pool-size "$MINE_POOL" --output-dir "$mined"
      mkdir -p "$OUT" && cp "$mined/mining.json" "$OUT/hn-mining.json"  # its counts and times, beside the rows
      data=$(for f in ${files//,/ }; do printf '%s,' "$mined/$(basename "$f")"; done)
      data=${data%,} ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  if [ "$variant" = gem-start ]; then
    train_run "$RUNS/$GEM_RUN" --model "$MODEL" --method gem --data "$DATA/pretrain/wikipedia_paragraphs.jsonl" \
      --num-summary-tokens 1 --steps "$GEM_STEPS" --gem-switch-step "$GEM_SWITCH" --batch-size 32 \
      --micro-batch-size 32 --max-length 64
  elif [ ${#init[@]} -gt 0 ]; then
    # shellcheck disable=SC2086  # UNIMAE_FLAGS is a word list on purpose
    train_run "$RUNS/$UNIMAE_RUN" --model "$MODEL" --method unimae $UNIMAE_FLAGS
  fi
  train_run "$RUNS/choices/$variant" --model "$MODEL" --method contrastive "${init[@]}" --data "$data" \
    --data-weights sqrt --steps "$STEPS" --batch-size "$BATCH" --micro-batch-size "$BATCH" \
    --grad-cache-chunk "$CHUNK" --max-length 128 --save-every 5 "${flags[@]}"
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$RUNS/choices/$variant/adapter" --tasks dev \
    --data-dir "$DATA" --output-dir "$OUT" --label "$variant" --max-length "$EVAL_MAX_LENGTH"
done
done_labels=()  # every variant scored so far, in this order (a later sitting's VARIANTS adds rows, drops none)
for variant in plain prompts prompts-mrl mrl base-start t0.02 prompts-drop gem-start seed1 hn len256; do
  [ -f "$OUT/$variant/run.json" ] && done_labels+=("$variant")
done
$UNIMAE evaluate summary --output-dir "$OUT" --tasks dev --name summary --labels "${done_labels[@]}"
