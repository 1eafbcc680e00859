#!/usr/bin/env bash
# The paper's Table 1 (dev suite) for one base model: MEAN, ECHO, MNTP, UniMAE, MNTP+SimCSE,
# UniMAE+SimCSE, GEM, and all-MiniLM-L6-v2 as the reference row. Each row trains (if needed) and is then
# evaluated, so rows land one by one. Every stage resumes: rerunning skips finished training runs
# (recipes/train_run.sh), continues interrupted ones, and skips finished tasks (their JSON exists for the
# same model, adapter and pooling).
#   MODEL=smollm2-135m bash recipes/table1.sh        (about 8 h on 2 CPU cores with TASKS=dev)
#   MODEL=gemma3-270m  bash recipes/table1.sh
# Environment: TASKS (default "dev"; a space-separated task list for a cheaper run), RUNS (training
# runs), OUT (results), GEM_STEPS / GEM_SWITCH (GEM's length and its NTP -> contrastive switch step;
# default 300 and 100, the budget of the committed rows; the paper: 1,000 and 100), SIMCSE_STEPS
# (length of each SimCSE stage; default 60, the committed rows' budget), TRAIN_FLAGS (extra
# `unimae train` flags for every run, e.g. "--batch-size 8 --max-length 64" for a cheaper table; the
# per-method flags above come after them and win; GEM keeps its own budget, 32 rows of 64 tokens per step).
# GEM's row is its k ablation's k = 1 run: trained into RUNS/gem/k1, scored into results/ablation-gem-k-MODEL.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
OUT=${OUT:-results/table1-$MODEL}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
TASKS=${TASKS:-dev}
GEM_STEPS=${GEM_STEPS:-300}
GEM_SWITCH=${GEM_SWITCH:-100}
SIMCSE_STEPS=${SIMCSE_STEPS:-60}
TRAIN_FLAGS=${TRAIN_FLAGS:-}

# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"
train() {  # name, then train flags (see train_run.sh: resumes an interrupted run, skips a finished one)
  local name=$1; shift
  # shellcheck disable=SC2086  # TRAIN_FLAGS is a word list on purpose
  train_run "$RUNS/$name" --model "$MODEL" $TRAIN_FLAGS "$@"
}
evaluate() {  # label, then evaluate flags
  local label=$1; shift
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --tasks $TASKS --data-dir "$DATA" --output-dir "$OUT" \
    --label "$label" "$@"
}

evaluate base-mean --pooling mean
evaluate base-echo --pooling echo
evaluate all-MiniLM-L6-v2 --reference
train unimae --method unimae
evaluate unimae-eos --adapter "$RUNS/unimae/adapter"
train mntp --method mntp
evaluate mntp-mean --adapter "$RUNS/mntp/adapter"
# GEM: the paper's recipe, run by its k ablation (k = 1, the paper's default, is this table's row)
# (every variable named, so this recipe's own RUNS / OUT / TRAIN_FLAGS from the environment do not leak into it)
GEM_OUT=results/ablation-gem-k-$MODEL
MODEL=$MODEL K_VALUES=1 STEPS=$GEM_STEPS SWITCH=$GEM_SWITCH TASKS="$TASKS" RUNS="$RUNS/gem" OUT="$GEM_OUT" \
  TRAIN_FLAGS="" UNIMAE="$UNIMAE" bash recipes/gem_ablation.sh
train unimae-simcse --method simcse --steps "$SIMCSE_STEPS" --init-adapter "$RUNS/unimae/adapter"
evaluate unimae-simcse-eos --adapter "$RUNS/unimae-simcse/adapter"
train mntp-simcse --method simcse --steps "$SIMCSE_STEPS" --init-adapter "$RUNS/mntp/adapter"
evaluate mntp-simcse-mean --adapter "$RUNS/mntp-simcse/adapter"
# shellcheck disable=SC2086  # TASKS is a word list on purpose
$UNIMAE evaluate summary --output-dir "$OUT" --tasks $TASKS --name table1 --labels base-mean base-echo mntp-mean \
  unimae-eos mntp-simcse-mean unimae-simcse-eos "gem-summary=$GEM_OUT/k=1" all-MiniLM-L6-v2
