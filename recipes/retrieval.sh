#!/usr/bin/env bash
# The released one-model retriever: the supervised contrastive stage on the [EOS] embedding (UniMAE paper App. D),
# causal attention throughout, so the adapter still generates and reuses the query's KV cache in RAG; with the
# query prompt on asymmetric sources, Matryoshka dimensions and a next-token term that keeps generation from
# looping (docs/methods.md, "Supervised contrastive"; the choices: recipes/retrieval_choices.sh and
# docs/results.md). Then the Matryoshka rotation (`unimae rotation`), the dev suite, the per-dimension table, the RAG benchmark, the generation suites, the
# greedy-repetition check, and the release (releases/RELEASE).
#   MODEL=gemma3-270m bash recipes/retrieval.sh
#   MODEL=smollm2-135m bash recipes/retrieval.sh
# Budget: SUP_STEPS steps of SUP_BATCH pairs (default 560 x 256: every one of the ~149k pairs seen about once),
# evaluated every CURVE_EVERY steps (dev suite with texts cut to CURVE_MAX_LENGTH tokens: results/retrieval-
# <short>/curve/curve.json); with STOP_EARLY=1 the run stops when the dev average did not rise over the last
# CURVE_EVERY steps, and the final stage takes the better adapter of the point before: $run/adapter-best (kept at
# each point that rose), else the release if it was made from that very adapter (its source revision); it keeps
# the later adapter in $run/adapter-step-N and notes the stop in $run/stopped-early.json, so a later sitting with
# STOP_EARLY=1 does not train on (delete the file to go on). Each point that rose is released at once (the rotation
# fit and the per-size rows: minutes). On 2 CPU cores about 67 s (SmolLM2) / 92 s (Gemma) a step: many sittings.
# Sittings: every stage resumes (recipes/train_run.sh) and finished evaluations are skipped. On a fresh machine,
# where the run's checkpoints are gone, the supervised stage continues from the release it left
# (`unimae train --continue-adapter releases/RELEASE`: the same LoRA and data order, Adam restarted), and a stop
# the curve recorded there (a point below the one before it) holds: the final stage takes the release's weights. To
# end a sitting: SIGTERM the training (it writes its adapter at the step it reached), then `RELEASE_ONLY=1 bash
# recipes/retrieval.sh` writes the release from that adapter and its last curve point (where the run's adapter is
# gone, or a lengthened cooldown stopped before its curve point, it rewrites the release's card: `unimae release
# --card-only`).
# COOLDOWN=N (default 0: off): after a stop, the best point's adapter trains N more steps (into $RUNS/$SUP_RUN-
# cooldown, `--continue-adapter`) with --lr decaying linearly to 0 (`--lr-schedule linear`), on the batches the
# constant-rate run saw after it; its curve point (label cooldown-step-M) replaces the best point, and is released,
# if its dev average rose above it. Every later sitting, here or on a fresh machine, with COOLDOWN set or not, keeps
# that decision (read from the curve, the cooldown's folder and the release); to try another N, delete
# $RUNS/$SUP_RUN-cooldown and the curve point first. COOLDOWN_SCHEDULE=constant keeps the learning rate instead of
# the decay; DISTILL_WEIGHT=W (default 0: off) adds in-batch distillation from TEACHER to the cooldown's steps
# (`--distill-teacher TEACHER --distill-weight W`; TEACHER defaults to all-mpnet-base-v2 from recipes/get_teacher.sh):
# `COOLDOWN=31 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4` continues the best point 31 steps with distillation.
# DISTILL_LOSS=similarity distills the teacher's cosine of every pair of the batch's texts instead of each query's
# softmax (`--distill-loss similarity`; its weight is on another scale: benchmarks/distill_balance.py).
# A constant-rate cooldown lengthens: a later sitting with a larger COOLDOWN (the same other settings) resumes its
# checkpoints up to the new end (as one longer cooldown would have gone; on a fresh machine, where they are gone,
# it continues the released cooldown: its bf16 weights, Adam restarted, the card still counting the distilled steps
# from the best point) and scores that point; it replaces the released cooldown if its dev average rose above it, else
# the final stage takes the release again (the longer adapter kept in $RUNS/$SUP_RUN-cooldown/adapter-step-M). A
# decayed cooldown does not lengthen (its rate reached 0), no cooldown shortens, a fresh-machine lengthening keeps the
# release's DISTILL_WEIGHT, and COOLDOWN_SCHEDULE=constant needs DISTILL_WEIGHT: the recipe refuses the others.
# Environment: RUNS, OUT, DEV, PAIRS, RELEASE (default unimae-<model>-retriever), SUP_RUN (default retriever),
# START (unimae, the default: the supervised stage trains the UniMAE stage's own LoRA further, `--init-lora`, so
# the release stays one LoRA; none: a fresh LoRA on the base model; the choice: docs/results.md), SUP_STEPS,
# SUP_BATCH (256), SUP_CHUNK (gradient-cache chunk, 32), SUP_MAX_LENGTH (128), SUP_WEIGHTS (sqrt), TEMPERATURE,
# SUP_FLAGS (more flags), CURVE_EVERY (80), CURVE_MAX_LENGTH (256), STOP_EARLY (1), TASKS (dev; "" skips the
# evaluations), RAG_QUESTIONS (20; 0 skips), GENERATION (1; 0 skips), RELEASE_ONLY (1: only write the release),
# COOLDOWN (0), COOLDOWN_SCHEDULE (linear), DISTILL_WEIGHT (0), DISTILL_LOSS (listwise), TEACHER. The release card's
# command repeats MODEL and each of the training and curve settings the caller set (the cooldown's: read from the
# released adapter).
set -euo pipefail
shopt -s inherit_errexit  # a failing command inside $(...) fails the recipe too
chosen=()  # the recipe settings the caller set, which the release card's command repeats (COOLDOWN: see release)
for name in START SUP_RUN OUT SUP_STEPS SUP_BATCH SUP_CHUNK SUP_MAX_LENGTH SUP_WEIGHTS TEMPERATURE SUP_FLAGS \
  CURVE_EVERY CURVE_MAX_LENGTH STOP_EARLY WIKI QUERY_PROMPT SYMMETRIC MRL_DIMS; do
  [ -z "${!name+x}" ] || chosen+=("$name=$(printf '%q' "${!name}")")
done
MODEL=${MODEL:-smollm2-135m}
DATA=${UNIMAE_DATA:-../shared/data}
RUNS=${RUNS:-runs/$MODEL}
SHORT=${MODEL%%-*}  # smollm2-135m -> smollm2, gemma3-270m -> gemma3
OUT=${OUT:-results/retrieval-$SHORT}
DEV=${DEV:-results/dev-$SHORT}
PAIRS=${PAIRS:-../data-pairs}
UNIMAE=${UNIMAE:-.venv/bin/unimae}
PYTHON=${PYTHON:-.venv/bin/python}
RELEASE=${RELEASE:-unimae-$MODEL-retriever}
RELEASES=${RELEASES:-releases}
SUP_RUN=${SUP_RUN:-retriever}
START=${START:-unimae}
SUP_STEPS=${SUP_STEPS:-560}
SUP_BATCH=${SUP_BATCH:-256}
SUP_CHUNK=${SUP_CHUNK:-32}
SUP_MAX_LENGTH=${SUP_MAX_LENGTH:-128}
SUP_WEIGHTS=${SUP_WEIGHTS:-sqrt}
TEMPERATURE=${TEMPERATURE:-0.05}
SUP_FLAGS=${SUP_FLAGS:-}
CURVE_EVERY=${CURVE_EVERY:-80}
CURVE_MAX_LENGTH=${CURVE_MAX_LENGTH:-256}
STOP_EARLY=${STOP_EARLY:-1}
TASKS=${TASKS-dev}
RAG_QUESTIONS=${RAG_QUESTIONS:-20}
GENERATION=${GENERATION:-1}
GEN_OUT=results/generation-$SHORT/retrieval  # the release's generation suite (final_stage.sh)
RELEASE_ONLY=${RELEASE_ONLY:-0}
COOLDOWN=${COOLDOWN:-0}
COOLDOWN_SCHEDULE=${COOLDOWN_SCHEDULE:-linear}
DISTILL_WEIGHT=${DISTILL_WEIGHT:-0}
DISTILL_LOSS=${DISTILL_LOSS:-listwise}
TEACHER=${TEACHER:-}
case $COOLDOWN_SCHEDULE in
  linear | constant) ;;
  *) echo "retrieval.sh: COOLDOWN_SCHEDULE must be linear or constant, not '$COOLDOWN_SCHEDULE'" >&2; exit 2 ;;
esac
if [ "$COOLDOWN" -gt 0 ] && [ "$COOLDOWN_SCHEDULE" = constant ] && awk "BEGIN { exit !($DISTILL_WEIGHT <= 0) }"; then
  echo "retrieval.sh: COOLDOWN_SCHEDULE=constant needs DISTILL_WEIGHT > 0 (without distillation a constant-rate" \
    "cooldown is the supervised stage going on: raise SUP_STEPS instead)" >&2
  exit 2
fi

# shellcheck source=recipes/retrieval_data.sh
source "$(dirname "$0")/retrieval_data.sh"  # $files, $QUERY_PROMPT, $SYMMETRIC, $MRL_DIMS
# shellcheck source=recipes/train_run.sh
source "$(dirname "$0")/train_run.sh"
# shellcheck source=recipes/json_field.sh
source "$(dirname "$0")/json_field.sh"  # json_field FILE KEY...
# shellcheck source=recipes/final_stage.sh
source "$(dirname "$0")/final_stage.sh"  # final_stage ADAPTER, rotation_of ADAPTER

run=$RUNS/$SUP_RUN
cool=$RUNS/$SUP_RUN-cooldown
point=step  # curve labels of the run's adapter: step-N, or cooldown-step-N once a cooldown replaced the best point
init=()
if [ "$START" = unimae ]; then  # the UniMAE stage is needed only to start the supervised one afresh
  if [ ! -d "$run/checkpoints" ] && [ ! -f "$run/adapter/adapter_config.json" ] && [ ! -f "$RELEASES/$RELEASE/unimae.json" ]; then
    train_run "$RUNS/unimae" --model "$MODEL" --method unimae
  fi
  init=(--init-lora "$RUNS/unimae/adapter")
fi
# shellcheck disable=SC2206  # SUP_FLAGS is a word list on purpose
sup_flags=(--model "$MODEL" --method contrastive "${init[@]}" --data "$files" --data-weights "$SUP_WEIGHTS"
  --batch-size "$SUP_BATCH" --micro-batch-size "$SUP_BATCH" --grad-cache-chunk "$SUP_CHUNK"
  --max-length "$SUP_MAX_LENGTH" --save-every 5 --temperature "$TEMPERATURE" --query-prompt "$QUERY_PROMPT"
  --symmetric-sources "$SYMMETRIC" --matryoshka-dims "$MRL_DIMS" --lm-weight 0.1 --lm-texts 64 $SUP_FLAGS)

train_to() {  # steps: the supervised stage up to that many steps (resumed, or continued from the release)
  if [ ! -d "$run/checkpoints" ] && [ ! -f "$run/adapter/adapter_config.json" ] && [ -f "$RELEASES/$RELEASE/unimae.json" ]; then
    if [ -n "$(cooled_from "$RELEASES/$RELEASE")" ]; then
      echo "retrieval.sh: the release is a cooldown (a learning-rate decay or distillation): the constant-rate stage" \
        "cannot continue from it (its curve points are missing from $OUT/curve)" >&2
      exit 1
    fi
    $UNIMAE train --continue-adapter "$RELEASES/$RELEASE" --output-dir "$run" "${sup_flags[@]}" --steps "$1"
  else
    train_run "$run" "${sup_flags[@]}" --steps "$1"
  fi
}

adapter_steps() {  # [folder]: the steps the run's adapter (or that folder) holds ('' without one)
  json_field "${1:-$run/adapter}/unimae.json" trained_steps
}

curve_point() {  # steps: the dev suite of the adapter at that step (texts cut to CURVE_MAX_LENGTH tokens)
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$run/adapter" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$OUT/curve" --label "step-$1" --max-length "$CURVE_MAX_LENGTH"
}

rotate() {  # the run's adapter's Matryoshka rotation, once
  rotation_of "$run/adapter"
}

curve_dimensions() {  # steps: the curve point's tasks at each Matryoshka size (labels pca-dK-step-N: not curve
  # rows), after the rotation, scored from the vectors the curve point cached; prints the summary's path
  local labels=("$point-$1") tasks
  tasks=$(json_field "$OUT/curve/$point-$1/run.json" tasks)
  rotate
  for d in ${MRL_DIMS//,/ }; do
    # shellcheck disable=SC2086  # tasks is a word list on purpose
    $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$run/adapter" --tasks $tasks --data-dir "$DATA" \
      --output-dir "$OUT/curve" --label "pca-d$d-$point-$1" --max-length "$CURVE_MAX_LENGTH" --dimensions "$d" >&2
    labels+=("pca-d$d-$point-$1")
  done
  # shellcheck disable=SC2086
  $UNIMAE evaluate summary --output-dir "$OUT/curve" --tasks $tasks --name "dimensions-$point-$1" --labels "${labels[@]}" >&2
  echo "$OUT/curve/dimensions-$point-$1.json"
}

released_from() {  # adapter: true if the release was made from that adapter (or is a copy of it)
  $PYTHON - "$1" "$RELEASES/$RELEASE" <<'EOF'
import sys
from pathlib import Path
from unimae.release import release_meta, release_revisions
made = Path(sys.argv[2], "unimae.json").is_file() and release_meta(sys.argv[2]).release
sys.exit(0 if made and made.source_revision in release_revisions(sys.argv[1]) else 1)
EOF
}

scored_for() {  # folder adapter: true if the folder's run.json was evaluated for that adapter as it is now (for a
  # release: for its bf16 weights or for the trained adapter it was made from)
  $PYTHON - "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
from unimae.release import release_revisions
record = Path(sys.argv[1]) / "run.json"
sys.exit(0 if record.is_file() and json.loads(record.read_text()).get("revision") in release_revisions(sys.argv[2]) else 1)
EOF
}

release() {  # [card-only]: releases/RELEASE from the run's adapter, its card from the results of that very adapter;
  # on a fresh machine, where the run's adapter is gone (or when asked), the release's card alone, from the results of
  # its own weights
  local adapter=$run/adapter write=(--adapter "$run/adapter") dev=$OUT/retrieval-eos summary=() steps
  local dims=$OUT/dimensions.json command="MODEL=$MODEL ${chosen[*]:+${chosen[*]} }bash recipes/retrieval.sh"
  if [ "${1:-}" = card-only ] || { [ ! -f "$adapter/unimae.json" ] && [ -f "$RELEASES/$RELEASE/unimae.json" ]; }; then
    adapter=$RELEASES/$RELEASE
    write=(--card-only)
  fi
  steps=$(adapter_steps "$adapter")
  if scored_for "$OUT/curve/cooldown-step-$steps" "$adapter"; then  # a cooldown's adapter (RELEASE_ONLY finds it so)
    point=cooldown-step
  fi
  [ "$point" = step ] || command="$(cooldown_settings "$adapter" "$steps") $command"
  if scored_for "$dev" "$adapter"; then
    summary=(--summary "$OUT/summary.json")
  else  # a sitting's end: the curve point of the adapter's step, or at least STS17 (the release test's task)
    dev=$OUT/curve/$point-$steps
    if [ "${write[0]}" = --card-only ]; then
      dims=$OUT/curve/dimensions-$point-$steps.json  # written when the release was made
    else
      scored_for "$dev" "$adapter" || $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$adapter" \
        --tasks STS17 --data-dir "$DATA" --output-dir "$OUT/curve" --label "$point-$steps" --max-length "$CURVE_MAX_LENGTH"
      dims=$(curve_dimensions "$steps")
    fi
  fi
  $UNIMAE release "${write[@]}" --name "$RELEASE" --root "$RELEASES" --dev-results "$dev" "${summary[@]}" \
    --generation "$GEN_OUT/generation.json" \
    --base-generation "results/generation-$SHORT/base-full-scorer/generation.json" --rag "$OUT/rag.json" \
    --repetition "results/generation-$SHORT/greedy-repetition.json" \
    --repetition "results/generation-$SHORT/greedy-repetition-wiki-heldout.json" --table "$dims" \
    --table "$OUT/curve/curve.json" --train-log "$run/log.jsonl" --command "$command"
}

decay_from() {  # adapter: the step its learning-rate decay started at (--lr-decay-from); '' for a constant rate
  local schedule
  schedule=$(json_field "$1/unimae.json" training_config options lr_schedule)
  [ -z "$schedule" ] || [ "$schedule" = constant ] || json_field "$1/unimae.json" training_config options lr_decay_from
}

cooled_from() {  # adapter: the step a cooldown of it started at: its decay's start, else, for a distilled
  # continuation (a constant-rate cooldown), the step its distillation began at (a cooldown lengthened from the
  # release records it), else the step it continued from; '' for the supervised stage's adapters
  local from
  from=$(decay_from "$1")
  if [ -z "$from" ] && [ -n "$(json_field "$1/unimae.json" training_config options distill_teacher)" ]; then
    from=$(json_field "$1/unimae.json" continued_from distill_from)
    [ -n "$from" ] || from=$(json_field "$1/unimae.json" continued_from step)
  fi
  echo "$from"
}

cooldown_settings() {  # adapter steps: the recipe settings that made that cooldown adapter, for the card's command
  local from weight teacher loss settings
  from=$(cooled_from "$1")
  settings="COOLDOWN=$(($2 - from))"
  [ -n "$(decay_from "$1")" ] || settings+=" COOLDOWN_SCHEDULE=constant"
  teacher=$(json_field "$1/unimae.json" training_config options distill_teacher)
  if [ -n "$teacher" ]; then
    weight=$(json_field "$1/unimae.json" training_config options distill_weight)
    settings+=" DISTILL_WEIGHT=${weight%.0}"
    loss=$(json_field "$1/unimae.json" training_config options distill_loss)
    [ "${loss:-listwise}" = listwise ] || settings+=" DISTILL_LOSS=$loss"
    [ "${teacher##*/}" = "$(basename "$(default_teacher)")" ] || settings+=" TEACHER=$(printf '%q' "$teacher")"
  fi
  echo "$settings"
}

default_teacher() {  # the folder recipes/get_teacher.sh fetches the distillation teacher into (fetching nothing)
  bash "$(dirname "$0")/get_teacher.sh" --where
}

cooldown_flags() {  # best: the cooldown's own training flags (its schedule, its distillation) -> the array cool_flags
  cool_flags=()
  [ "$COOLDOWN_SCHEDULE" = constant ] || cool_flags+=(--lr-schedule linear --lr-decay-from "$1")
  if [ "$DISTILL_WEIGHT" != 0 ]; then
    [ -n "$TEACHER" ] || TEACHER=$(bash "$(dirname "$0")/get_teacher.sh")
    cool_flags+=(--distill-teacher "$TEACHER" --distill-weight "$DISTILL_WEIGHT")
    [ "$DISTILL_LOSS" = listwise ] || cool_flags+=(--distill-loss "$DISTILL_LOSS")
  fi
}

steps_held() {  # the constant-rate stage's steps the run's adapter holds, else the release's (a fresh machine:
  # for a released cooldown, the step it cooled from, whose curve point the next one is judged against), else 0
  local steps
  steps=$(adapter_steps)
  if [ -z "$steps" ] && [ -f "$RELEASES/$RELEASE/unimae.json" ]; then
    steps=$(cooled_from "$RELEASES/$RELEASE")
    [ -n "$steps" ] || steps=$(adapter_steps "$RELEASES/$RELEASE")
  fi
  echo "${steps:-0}"
}

revision_of() {  # kind path: the adapter revision an evaluation's run.json scored (scored), a folder's weights
  # hash (folder), or the revision a release was made from (release); '' when absent
  case $1 in
    scored) json_field "$2" revision ;;
    release) json_field "$2/unimae.json" release source_revision ;;
    folder) [ ! -f "$2/adapter_model.safetensors" ] \
      || $PYTHON -c 'import sys; from unimae.adapter import adapter_revision; print(adapter_revision(sys.argv[1]))' "$2" ;;
  esac
}

keep_best() {  # the run's adapter, just scored and released as the best point so far -> $run/adapter-best
  rm -rf "$run/adapter-best.tmp"
  cp -r "$run/adapter" "$run/adapter-best.tmp"
  rm -rf "$run/adapter-best"
  mv "$run/adapter-best.tmp" "$run/adapter-best"
}

copy_adapter() {  # source folder: the adapter's files (and its Matryoshka rotation) into that folder, made afresh
  rm -rf "$2"
  mkdir -p "$2"
  cp "$1"/{adapter_model.safetensors,adapter_config.json,unimae.json} "$2/"
  if [ -f "$1/matryoshka_rotation.safetensors" ]; then
    cp "$1/matryoshka_rotation.safetensors" "$2/"
  fi
}

restore_best() {  # best last: the dev average fell from step best to step last -> the run's adapter is best's again
  local want source=""
  want=$(revision_of scored "$OUT/curve/step-$1/run.json")
  if [ -n "$want" ] && [ "$(revision_of folder "$run/adapter-best")" = "$want" ]; then
    source=$run/adapter-best
  elif [ -n "$want" ] && [ "$(revision_of release "$RELEASES/$RELEASE")" = "$want" ]; then
    source=$RELEASES/$RELEASE  # made from step best's adapter (its weights in bf16)
  elif [ -f "$RELEASES/$RELEASE/unimae.json" ] && [ "$(cooled_from "$RELEASES/$RELEASE")" = "$1" ]; then
    echo "retrieval.sh: the release is step $1's cooldown (an earlier sitting's); the cooldown stage takes it"
    mkdir -p "$run"
    printf '{"best": %s, "stopped_at": %s, "adapter": ""}\n' "$1" "$2" >"$run/stopped-early.json"
    return 0
  else
    echo "retrieval.sh: neither $run/adapter-best nor the release is step $1's adapter: the final stage takes the run's"
    return 0
  fi
  rm -rf "$run/adapter-step-$2"
  copy_adapter "$source" "$run/adapter.restore"
  if [ -d "$run/adapter" ]; then  # else a fresh machine: step $2's adapter went with the earlier one's machine
    mv "$run/adapter" "$run/adapter-step-$2"
  fi
  mv "$run/adapter.restore" "$run/adapter"
  printf '{"best": %s, "stopped_at": %s, "adapter": "%s"}\n' "$1" "$2" "$source" >"$run/stopped-early.json"
  echo "retrieval.sh: the final stage takes step $1's adapter ($source); step $2's is in $run/adapter-step-$2"
}

rose() {  # from to: true if the curve's dev average rose from label 'from' to label 'to' (an error if either row
  # is missing or incomplete)
  local code=0
  $PYTHON - "$OUT/curve/curve.json" "$1" "$2" <<'EOF' || code=$?
import json, sys
rows = json.load(open(sys.argv[1]))
for label in sys.argv[2:]:
    if label not in rows or rows[label].get("missing"):
        print(f"retrieval.sh: the curve has no complete row {label} ({sys.argv[1]})", file=sys.stderr)
        sys.exit(2)
sys.exit(0 if rows[sys.argv[3]]["average"] > rows[sys.argv[2]]["average"] else 1)
EOF
  [ "$code" -le 1 ] || exit "$code"
  return "$code"
}

curve_labels() {  # pattern sort-key: the curve folder's points of that name pattern, in step order
  for folder in "$OUT"/curve/$1; do
    [ ! -d "$folder" ] || basename "$folder"
  done | sort -t- -k"$2" -n | tr '\n' ' '
}

curve_summary() {  # curve.json: every curve point, the constant-rate steps, then the cooldowns
  # shellcheck disable=SC2046  # the labels are a word list on purpose
  $UNIMAE evaluate summary --output-dir "$OUT/curve" --tasks $TASKS --name curve \
    --labels $(curve_labels 'step-*' 2) $(curve_labels 'cooldown-step-*' 3)
}

restore_release() {  # folder: the release's weights become that adapter folder
  copy_adapter "$RELEASES/$RELEASE" "$1.restore"
  rm -rf "$1"
  mv "$1.restore" "$1"
}

stopped_best() {  # the best step of the stop the run recorded
  json_field "$RUNS/$SUP_RUN/stopped-early.json" best
}

cooldown_stage() {  # after a stop: step best's adapter COOLDOWN more steps, --lr decaying linearly to 0 (or
  # constant), with distillation if DISTILL_WEIGHT, and its curve point (finished tasks are skipped)
  local best steps source
  best=$(stopped_best)
  steps=$((best + COOLDOWN))
  if [ -f "$OUT/curve/cooldown-step-$steps/run.json" ] && [ "$(adapter_steps "$cool/adapter")" != "$steps" ]; then
    scored_for "$OUT/curve/cooldown-step-$steps" "$RELEASES/$RELEASE" || echo "retrieval.sh: the curve holds" \
      "cooldown-step-$steps, an earlier sitting's cooldown that was not released: that decision stands (to train" \
      "this one, delete $OUT/curve/cooldown-step-$steps and $cool)"
    return 0
  fi
  if [ "$(adapter_steps "$cool/adapter")" != "$steps" ]; then
    source=$(cooldown_source "$best" "$steps")
    cooldown_flags "$best"
    train_run "$cool" "${sup_flags[@]}" --continue-adapter "$source" "${cool_flags[@]}" --steps "$steps"
  fi
  [ -n "$TASKS" ] || return 0
  # shellcheck disable=SC2086  # TASKS is a word list on purpose
  $UNIMAE evaluate embeddings --model "$MODEL" --adapter "$cool/adapter" --tasks $TASKS --data-dir "$DATA" \
    --output-dir "$OUT/curve" --label "cooldown-step-$steps" --max-length "$CURVE_MAX_LENGTH"
  curve_summary
}

cooldown_source() {  # best steps: the adapter a cooldown of step best to step steps continues (--continue-adapter):
  # step best's; a cooldown of it to another step held here (its adapter, else the release) lengthens: from its
  # checkpoints (the adapter its run continued), or on a fresh machine from the release (its bf16 weights, Adam
  # restarted, as the supervised stage goes on there); a decayed one (one stopped part-way resumes to its own end),
  # or one held here without checkpoints, is refused
  local held=$cool/adapter end source checkpoints="" from weight
  from=$(cooled_from "$held")
  [ "$from" = "$1" ] || { held=$RELEASES/$RELEASE; from=$(cooled_from "$held"); }
  end=$(adapter_steps "$held")
  ! compgen -G "$cool/checkpoints/step-*" >/dev/null || checkpoints=$(json_field "$cool/config.json" steps)
  if [ "$from" != "$1" ] || [ "$end" = "$2" ]; then  # no cooldown of step best held: start one
    if [ "$(adapter_steps)" != "$1" ]; then
      echo "retrieval.sh: $run/adapter is not step $1's adapter; the cooldown starts from it" >&2
      exit 1
    fi
    echo "$run/adapter"
  elif (( end > $2 )) || { [ -n "$checkpoints" ] && (( checkpoints > $2 )); }; then
    echo "retrieval.sh: $held is a longer cooldown of step $1 (to step ${checkpoints:-$end}) than COOLDOWN=$(($2 - $1));" \
      "a cooldown does not shorten" >&2
    exit 1
  elif [ "$checkpoints" != "$2" ] && { [ "$COOLDOWN_SCHEDULE" != constant ] || [ -n "$(decay_from "$held")" ]; }; then
    echo "retrieval.sh: $held is a cooldown of step $1 to step $end; a decayed one does not lengthen: delete" \
      "$cool and $OUT/curve/cooldown-step-$end to try COOLDOWN=$(($2 - $1))" >&2
    exit 1
  elif [ -n "$checkpoints" ]; then  # stopped part-way, or lengthened: resumed, from the adapter its run continued
    source=$(json_field "$cool/config.json" continue_adapter)
    echo "${source:-$run/adapter}"
  elif [ "$held" = "$RELEASES/$RELEASE" ] && [ ! -e "$cool" ]; then  # a fresh machine: at the release's own weight
    weight=$(json_field "$held/unimae.json" training_config options distill_weight)
    if ! awk "BEGIN { exit !(${weight:-0} == $DISTILL_WEIGHT) }"; then
      echo "retrieval.sh: the released cooldown of step $1 was distilled at weight ${weight:-0}, not" \
        "DISTILL_WEIGHT=$DISTILL_WEIGHT: a lengthening goes on as it went" >&2
      exit 1
    fi
    echo "retrieval.sh: lengthening the released cooldown of step $1 (step $end) to step $2 on a machine without" \
      "its checkpoints: it continues from the release (bf16 weights, Adam restarted)" >&2
    echo "$RELEASES/$RELEASE"
  else
    echo "retrieval.sh: lengthening the cooldown of step $1 ($held, step $end) to step $2 resumes its" \
      "checkpoints, which are not in $cool on this machine" >&2
    exit 1
  fi
}

released_cooldown() {  # best steps: the step of the release, if it is an earlier, scored cooldown of step best ('')
  local held
  held=$(adapter_steps "$RELEASES/$RELEASE")
  if [ -n "$held" ] && [ "$held" -lt "$2" ] && [ "$(cooled_from "$RELEASES/$RELEASE")" = "$1" ] \
    && [ -f "$OUT/curve/cooldown-step-$held/run.json" ]; then
    echo "$held"
  fi
}

took_cooldown() {  # true if a cooldown of the stop's best step rose above it: run and point switch to its adapter (on
  # a fresh machine restored from the release made of it; a lengthened cooldown that fell below the released one: the
  # release's)
  local best steps="" held
  best=$(stopped_best)
  if [ -f "$cool/adapter/unimae.json" ] && [ "$(cooled_from "$cool/adapter")" = "$best" ]; then
    steps=$(adapter_steps "$cool/adapter")
  elif [ -f "$RELEASES/$RELEASE/unimae.json" ] && [ "$(cooled_from "$RELEASES/$RELEASE")" = "$best" ]; then
    steps=$(adapter_steps "$RELEASES/$RELEASE")
  fi
  [ -n "$steps" ] && [ -f "$OUT/curve/cooldown-step-$steps/run.json" ] || return 1
  held=$(released_cooldown "$best" "$steps")
  if [ -n "$held" ] && ! rose "cooldown-step-$held" "cooldown-step-$steps"; then  # a lengthened cooldown that fell
    echo "retrieval.sh: the lengthened cooldown (cooldown-step-$steps) did not rise above the released one" \
      "(cooldown-step-$held): the final stage takes the release; step $steps's adapter is in $cool/adapter-step-$steps"
    rm -rf "$cool/adapter-step-$steps"
    mv "$cool/adapter" "$cool/adapter-step-$steps"
    restore_release "$cool/adapter"
    steps=$held  # the released cooldown, which rose above step best: taken below
  fi
  if ! rose "step-$best" "cooldown-step-$steps"; then
    echo "retrieval.sh: the cooldown (cooldown-step-$steps) did not rise above step-$best: the final stage takes" \
      "step $best's adapter"
    return 1
  fi
  if ! scored_for "$OUT/curve/cooldown-step-$steps" "$cool/adapter"; then
    if ! scored_for "$OUT/curve/cooldown-step-$steps" "$RELEASES/$RELEASE"; then
      echo "retrieval.sh: cooldown-step-$steps rose, but neither $cool/adapter nor the release is its adapter; delete" \
        "$OUT/curve/cooldown-step-$steps to train the cooldown again" >&2
      exit 1
    fi
    restore_release "$cool/adapter"  # a fresh machine: the release was made from the cooldown's adapter
  fi
  echo "retrieval.sh: the cooldown (cooldown-step-$steps) rose above step-$best: the final stage takes its adapter"
  run=$cool
  point=cooldown-step
}

point_after() {  # step: the curve's first constant-rate point past that step ('' if none)
  local label
  for label in $(curve_labels 'step-*' 2); do
    if (( ${label#step-} > $1 )); then
      echo "$label"
      return 0
    fi
  done
}

supervised_stage() {  # CURVE_EVERY steps at a time, with a dev-suite point after each
previous=""
held=$(steps_held)
for (( steps = CURVE_EVERY; steps < SUP_STEPS + CURVE_EVERY; steps += CURVE_EVERY )); do
  (( steps > SUP_STEPS )) && steps=$SUP_STEPS
  since=$previous  # the point the next one is judged against: the held adapter's own, where the curve has it (a
  # fresh machine whose release is off this CURVE_EVERY's grid), else the point before
  [ ! -f "$OUT/curve/step-$held/run.json" ] || since=step-$held
  next=$(point_after "$held")  # a sitting on another machine went on past the held step, on any CURVE_EVERY's grid
  if (( steps > held )) && [ "$STOP_EARLY" = 1 ] && [ -n "$since" ] && [ -n "$next" ] && ! rose "$since" "$next"; then
    echo "retrieval.sh: the curve holds $next, below $since: the stage stopped there in an earlier sitting"
    restore_best "${since#step-}" "${next#step-}"
    break
  fi
  if (( steps > held )); then
    train_to "$steps"
    held=$steps
  fi
  [ -n "$TASKS" ] || continue
  if [ "$(adapter_steps)" = "$steps" ]; then
    curve_point "$steps"  # finished tasks are skipped
  elif [ ! -f "$OUT/curve/step-$steps/run.json" ]; then
    echo "retrieval.sh: no curve point at step $steps (a sitting ended past it; its adapter is gone)"
    continue
  fi
  curve_summary
  if [ "$STOP_EARLY" = 1 ] && [ -n "$previous" ] && ! rose "$previous" "step-$steps"; then
    echo "retrieval.sh: the dev average did not rise from $previous to step-$steps: the stage stops here"
    restore_best "${previous#step-}" "$steps"
    break
  fi
  previous=step-$steps
  if [ "$STOP_EARLY" = 1 ] && [ "$(adapter_steps)" = "$steps" ] \
    && [ "$(revision_of release "$RELEASES/$RELEASE")" != "$(revision_of folder "$run/adapter")" ]; then
    release  # the best point so far becomes the release (a sitting may end at any time)
    keep_best
  fi
done
}

if [ "$RELEASE_ONLY" = 1 ]; then
  if [ -f "$run/stopped-early.json" ] && [ -f "$cool/adapter/unimae.json" ]; then
    cut=$(adapter_steps "$cool/adapter")
    if [ "$(cooled_from "$cool/adapter")" = "$(stopped_best)" ] && [ ! -f "$OUT/curve/cooldown-step-$cut/run.json" ] \
      && [ -n "$(released_cooldown "$(stopped_best)" "$cut")" ]; then
      echo "retrieval.sh: the lengthened cooldown was cut short at step $cut, before its curve point: the released" \
        "cooldown stands (its card rewritten); the next sitting resumes the lengthening"
      release card-only
      exit 0
    fi
    took_cooldown || true  # a cooldown that replaced the best point is what the release holds
  fi
  release
  exit 0
fi

if [ "$STOP_EARLY" = 1 ] && [ -f "$run/stopped-early.json" ]; then
  echo "retrieval.sh: the supervised stage stopped early ($(cat "$run/stopped-early.json")); on to the final stage"
else
  supervised_stage
fi
if [ "$STOP_EARLY" = 1 ] && [ -f "$run/stopped-early.json" ]; then
  if [ "$COOLDOWN" -gt 0 ]; then
    cooldown_stage
  fi
  if took_cooldown && ! released_from "$run/adapter"; then
    release
  fi
fi

if [ ! -f "$run/adapter/unimae.json" ] && [ "$(adapter_steps "$RELEASES/$RELEASE")" = "$SUP_STEPS" ]; then
  echo "retrieval.sh: the run reached SUP_STEPS on an earlier machine: the final stage takes the release's weights"
  restore_release "$run/adapter"
fi
final_stage "$run/adapter"
release
