#!/usr/bin/env bash
# One model for RAG: UniMAE -> UniMAE+SimCSE -> supervised contrastive on the [EOS] embedding (the UniMAE
# paper's App. D stage), causal attention throughout, so the adapter still generates and reuses the KV cache.
# Then the dev suite and the one-model RAG benchmark.
#   MODEL=smollm2-135m bash recipes/retrieval.sh
# Gemma-3-270M (its p_mar 0.5 UniMAE run; a next-token term keeps its generation from looping):
#   MODEL=gemma3-270m UNIMAE_RUN=unimae-p0.5 UNIMAE_LABEL=unimae-p0.5-eos UNIMAE_FLAGS="--p-mar 0.5" \
#     SUP_RUN=unimae-p0.5-simcse-suplm SUP_FLAGS="--lm-weight 0.1 --lm-texts 64" bash recipes/retrieval.sh
# Training wall time for SmolLM2-135M on 2 CPU cores (AMD EPYC, measured): about 1.9 h. UniMAE 100 steps 994 s,
# SimCSE 60 steps 524 s, supervised 80 steps of batch 256 5,334 s (1.46M tokens, 274 tokens/s; 67 s/step, wiki and
# medquad batches ~100 s). Evaluation after it: about 40 min (dev suite, SciFact most of it) + a few minutes (RAG).
# See docs/methods.md, "Supervised contrastive".
# Every stage resumes (recipes/train_run.sh): a finished stage is skipped, an interrupted one continues from
# its newest checkpoint (rerun the script), a larger SUP_STEPS lengthens a finished supervised stage, and
# finished evaluation tasks are skipped.
# The UniMAE and SimCSE stages are the runs of recipes/table1.sh (same RUNS folder and names): shared.
# Results: the final adapter is the row `retrieval-eos` in OUT (results/retrieval-<smollm2|gemma3>), and
# OUT/summary.json puts it next to `unimae-eos`, `base-echo` and `all-MiniLM-L6-v2` as scored in DEV
# (results/dev-<smollm2|gemma3>, by recipes/table1.sh from the same RUNS/unimae adapter; read there, not
# re-scored). The RAG benchmark (one model vs MiniLM + the same LLM) goes into results/rag-benchmark.json, and
# the generation suite (every item) to results/generation-<short>/retrieval, the base model's beside it in
# results/generation-<short>/base-full-scorer (SmolLM2: about 64 min for the adapter on AMD EPYC).
# Environment: RUNS, OUT, DEV, PAIRS (folder for the wiki pairs built here; outside the repository),
# SIMCSE_STEPS (default 60 as in Table 1; 0 skips SimCSE), SUP_STEPS (80), SUP_BATCH (256), SUP_CHUNK
# (gradient-cache chunk, 32), SUP_MAX_LENGTH (128), SUP_WEIGHTS (sqrt: square root of each file's size),
# UNIMAE_RUN (name of the UniMAE run in RUNS, default unimae; the later stages are named after it),
# UNIMAE_FLAGS (extra flags for that stage, e.g. "--p-mar 0.5"), UNIMAE_LABEL (its row in DEV, unimae-eos),
# SUP_FLAGS (extra flags for the supervised stage, e.g. "--symmetric-loss"), SUP_RUN (that stage's run name;
# default: the SimCSE run's name + "-sup", or the UniMAE run's when SIMCSE_STEPS=0), WIKI (1: add inverse-cloze
# pairs from pretrain/; 0: only the 8 files of train/), TASKS (dev suite by default; "" skips evaluation),
# RAG_QUESTIONS (20; 0 skips the RAG benchmark), GENERATION (1; 0 skips the generation suites).
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
SHORT=${MODEL%%-*}  # smollm2-135m -> smollm2, gemma3-270m -> gemma3
OUT=${OUT:-results/retrieval-$SHORT}
DEV=${DEV:-results/dev-$SHORT}
PAIRS=${PAIRS:-../data-pairs}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
PYTHON=${PYTHON:-.venv/bin/python}
SIMCSE_STEPS=${SIMCSE_STEPS:-60}
SUP_STEPS=${SUP_STEPS:-80}
SUP_BATCH=${SUP_BATCH:-256}
SUP_CHUNK=${SUP_CHUNK:-32}
SUP_MAX_LENGTH=${SUP_MAX_LENGTH:-128}
SUP_WEIGHTS=${SUP_WEIGHTS:-sqrt}
SUP_FLAGS=${SUP_FLAGS:-}
SUP_RUN=${SUP_RUN:-}
UNIMAE_RUN=${UNIMAE_RUN:-unimae}
UNIMAE_FLAGS=${UNIMAE_FLAGS:-}
UNIMAE_LABEL=${UNIMAE_LABEL:-unimae-eos}
TASKS=${TASKS-dev}
RAG_QUESTIONS=${RAG_QUESTIONS:-20}
GENERATION=${GENERATION:-1}

# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"
train() {  # name, then train flags (see train_run.sh: resumes an interrupted run, skips a finished one)
  local name=$1; shift
  train_run "$RUNS/$name" --model "$MODEL" "$@"
}

# The supervised pairs ($files; the 8 files of train/ and the wiki inverse-cloze pairs) and the prompts.
# shellcheck source=recipes/retrieval_data.sh
source "$(dirname "$0")/retrieval_data.sh"

# shellcheck disable=SC2086  # UNIMAE_FLAGS is a word list on purpose
train "$UNIMAE_RUN" --method unimae $UNIMAE_FLAGS
init=$RUNS/$UNIMAE_RUN/adapter
sup=$UNIMAE_RUN-sup
if [ "$SIMCSE_STEPS" -gt 0 ]; then
  train "$UNIMAE_RUN-simcse" --method simcse --steps "$SIMCSE_STEPS" --init-adapter "$init"
  init=$RUNS/$UNIMAE_RUN-simcse/adapter
  sup=$UNIMAE_RUN-simcse-sup
fi
sup=${SUP_RUN:-$sup}
# One batch of SUP_BATCH pairs per step, drawn from one source; the gradient cache embeds it in chunks of
# SUP_CHUNK texts, so the micro-batch is the whole batch (in-batch negatives span all of it).
# shellcheck disable=SC2086  # SUP_FLAGS is a word list on purpose
train "$sup" --method contrastive --init-adapter "$init" --data "$files" --data-weights "$SUP_WEIGHTS" \
  --steps "$SUP_STEPS" --batch-size "$SUP_BATCH" --micro-batch-size "$SUP_BATCH" --grad-cache-chunk "$SUP_CHUNK" \
  --max-length "$SUP_MAX_LENGTH" --save-every 5 $SUP_FLAGS

final=$RUNS/$sup/adapter
if [ -n "$TASKS" ]; then
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$final" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$OUT" --label retrieval-eos
  # shellcheck disable=SC2086
  $UNIMAE evaluate summary --output-dir "$OUT" --tasks $TASKS --name summary --labels retrieval-eos \
    "unimae-eos=$DEV/$UNIMAE_LABEL" "base-echo=$DEV/base-echo" "all-MiniLM-L6-v2=$DEV/all-MiniLM-L6-v2"
fi
if [ "$RAG_QUESTIONS" -gt 0 ]; then
  $PYTHON benchmarks/load_test.py --model "$MODEL" --adapter "$final" --skip-server \
    --questions "$RAG_QUESTIONS" --output "$OUT/rag.json"
fi
# The generation suite (every item) of the final adapter, then of the base model it is compared with (the
# unimae scorer for both); each task is skipped once written, so a stopped suite resumes.
if [ "$GENERATION" = 1 ]; then
  $UNIMAE evaluate generation --model "$MODEL" --adapter "$final" --data-dir "$DATA" \
    --output-dir "results/generation-$SHORT/retrieval"
  $UNIMAE evaluate generation --model "$MODEL" --data-dir "$DATA" --output-dir "results/generation-$SHORT/base-full-scorer"
fi
