# Sourced by recipes/retrieval.sh and recipes/wise.sh (needs $UNIMAE, $PYTHON and json_field): what a released
# retriever is measured by before its release. `final_stage ADAPTER`: the dev suite at full length (label
# retrieval-eos in $OUT; a row of another adapter is set aside by the evaluation), the Matryoshka rotation and the
# per-size rows, the summary beside the reference rows of $DEV, the index kinds, the RAG benchmark ($RAG_QUESTIONS;
# 0 skips), the greedy-repetition check and the generation suites into $GEN_OUT ($GENERATION; 0 skips). Each step
# skips what an earlier sitting finished. Reads MODEL, DATA, OUT, DEV, TASKS ("" skips the dev suite), MRL_DIMS,
# REPETITION_LABEL (release: the row the repetition check writes).

rotation_of() {  # adapter: its Matryoshka rotation (PCA of its embeddings of its own training pairs), once
  [ -n "$(json_field "$1/unimae.json" embedding rotation)" ] || $UNIMAE rotation --model "$MODEL" --adapter "$1" >&2
}

final_stage() {  # adapter
  local final=$1 dims dims_labels
  if [ -n "$TASKS" ]; then
    # shellcheck disable=SC2086  # TASKS is a word list on purpose
    $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$final" --tasks $TASKS --data-dir "$DATA" \
      --output-dir "$OUT" --label retrieval-eos
    rotation_of "$final"
    for dims in ${MRL_DIMS//,/ }; do  # the Matryoshka prefixes (after the rotation), from the same cached vectors
      # shellcheck disable=SC2086
      $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$final" --tasks $TASKS --data-dir "$DATA" \
        --output-dir "$OUT" --label "retrieval-eos-d$dims" --dimensions "$dims"
    done
    dims_labels=$(for d in ${MRL_DIMS//,/ }; do printf 'retrieval-eos-d%s ' "$d"; done)
    # shellcheck disable=SC2086
    $UNIMAE evaluate summary --output-dir "$OUT" --tasks $TASKS --name dimensions --labels retrieval-eos $dims_labels
    # shellcheck disable=SC2086
    $UNIMAE evaluate summary --output-dir "$OUT" --tasks $TASKS --name summary --labels retrieval-eos \
      "unimae-eos=$DEV/unimae-eos" "base-echo=$DEV/base-echo" "all-MiniLM-L6-v2=$DEV/all-MiniLM-L6-v2"
    $PYTHON benchmarks/index_kinds.py --model "$MODEL" --adapter "$final" --data-dir "$DATA" \
      --kinds flat sq8 binary binary-bits --dimensions 0 256 128 64 --label retrieval-eos --cache-dir "$OUT" \
      --output "$OUT/index-kinds.json"  # SciFact's vectors from the dev suite's cache
  fi
  if [ "$RAG_QUESTIONS" -gt 0 ]; then
    $PYTHON benchmarks/load_test.py --model "$MODEL" --adapter "$final" --skip-server \
      --questions "$RAG_QUESTIONS" --output "$OUT/rag.json"
  fi
  if [ "$GENERATION" = 1 ]; then
    local label=${REPETITION_LABEL:-release}  # own label: earlier rows stay
    $PYTHON benchmarks/greedy_repetition.py --model "$MODEL" --adapters none "$label=$final"
    $PYTHON benchmarks/greedy_repetition.py --model "$MODEL" --prompt-set wiki-heldout --prompts 64 --adapters none \
      "$label=$final"  # 64 held-out prompts: the paired difference from the base with its standard error
    $UNIMAE evaluate generation --model "$MODEL" --adapter "$final" --data-dir "$DATA" --output-dir "$GEN_OUT"
    $UNIMAE evaluate generation --model "$MODEL" --data-dir "$DATA" --output-dir "results/generation-$SHORT/base-full-scorer"
  fi
}
