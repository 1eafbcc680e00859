# Sourced by the recipes (needs $UNIMAE): `train_run DIR [unimae train flags...]` trains a run into DIR or
# finishes it.
# - DIR has checkpoints (step-* folders): `unimae train --resume` (it returns at once when the run's adapter is its last step's;
#   an interrupted run writes its adapter too, at the step it stopped, so an adapter alone does not mean done);
# - DIR has an adapter and no checkpoints: taken as finished;
# - otherwise a new run starts.
# The flags go to a resumed run as well: the same values change nothing, a larger --steps lengthens the run
# (with a constant learning rate, every method but GEM's cosine schedule, as the longer run would have gone).
train_run() {
  local dir=$1
  shift
  if compgen -G "$dir/checkpoints/step-*" > /dev/null; then  # not a .tmp-step-* a kill left mid-write
    $UNIMAE train --resume --output-dir "$dir" "$@"
  elif [ ! -f "$dir/adapter/adapter_config.json" ]; then
    $UNIMAE train --output-dir "$dir" "$@"
  fi
}
