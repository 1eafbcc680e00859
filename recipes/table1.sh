#!/usr/bin/env bash
# The paper's Table 1 (dev suite) for one base model: MEAN, ECHO, MNTP, UniMAE, MNTP+SimCSE,
# UniMAE+SimCSE, GEM, and all-MiniLM-L6-v2 as the reference row. Every stage resumes: rerunning
# skips finished training runs (their adapter exists) and finished tasks (their JSON exists).
#   MODEL=smollm2-135m bash recipes/table1.sh        (about 8 h on 2 CPU cores)
#   MODEL=gemma3-270m  bash recipes/table1.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
OUT=${OUT:-results/table1-$MODEL}
UNIMAE=${UNIMAE:-.venv/bin/unimae}

train() {  # name, then train flags
  local name=$1; shift
  if [ ! -f "$RUNS/$name/adapter/adapter_config.json" ]; then
    $UNIMAE train --model "$MODEL" --output-dir "$RUNS/$name" "$@"
  fi
}
evaluate() {  # label, then evaluate flags
  local label=$1; shift
  $UNIMAE evaluate embeddings --model "$MODEL" --tasks dev --data-dir "$DATA" --output-dir "$OUT" --label "$label" "$@"
}

train unimae --method unimae
train mntp --method mntp
train unimae-simcse --method simcse --init-adapter "$RUNS/unimae/adapter"
train mntp-simcse --method simcse --init-adapter "$RUNS/mntp/adapter"
# GEM: 100 NTP steps, then the contrastive switch (paper: after the first 100 steps)
train gem --method gem --steps 200 --gem-switch-step 100

evaluate MEAN --pooling mean
evaluate ECHO --pooling echo
evaluate MNTP --adapter "$RUNS/mntp/adapter"
evaluate UniMAE --adapter "$RUNS/unimae/adapter"
evaluate MNTP+SimCSE --adapter "$RUNS/mntp-simcse/adapter"
evaluate UniMAE+SimCSE --adapter "$RUNS/unimae-simcse/adapter"
evaluate GEM --adapter "$RUNS/gem/adapter"
evaluate all-MiniLM-L6-v2 --reference
$UNIMAE evaluate summary --output-dir "$OUT" \
  --labels MEAN ECHO MNTP UniMAE MNTP+SimCSE UniMAE+SimCSE GEM all-MiniLM-L6-v2
