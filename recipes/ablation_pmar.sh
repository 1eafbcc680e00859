#!/usr/bin/env bash
# The paper's Fig. 3a: UniMAE trained with p_mar in {0, 0.2, 0.4, 0.5, 0.6, 0.8}, dev-suite average vs p_mar.
#   MODEL=smollm2-135m bash recipes/ablation_pmar.sh      (about 6 x 45 min on 2 CPU cores)
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL-pmar}
OUT=${OUT:-results/ablation-pmar-$MODEL}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
labels=()
for p in 0 0.2 0.4 0.5 0.6 0.8; do
  if [ ! -f "$RUNS/p$p/adapter/adapter_config.json" ]; then
    $UNIMAE train --model "$MODEL" --p-mar "$p" --output-dir "$RUNS/p$p"
  fi
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$RUNS/p$p/adapter" --tasks dev --data-dir "$DATA" \
    --output-dir "$OUT" --label "p_mar=$p"
  labels+=("p_mar=$p")
done
$UNIMAE evaluate summary --output-dir "$OUT" --labels "${labels[@]}"
.venv/bin/python recipes/plot_ablation.py "$OUT/summary.json" "$OUT/pmar.png"
