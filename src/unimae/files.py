"""Small file helpers shared by every writer: atomic writes and the evaluation-data folder.

An atomic write goes to a hidden temporary file in the same folder and is renamed into place, so a
reader (or a run killed half-way) sees either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to fill a temporary file, then rename it to ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, payload) -> Path:
    """JSON with indent 2 and a final newline; objects JSON cannot hold are written as str()."""
    return atomic_write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def update_json(path: str | Path, updates: dict, under: str | None = None) -> Path:
    """Write ``updates``' keys into the JSON object at ``path`` (into its ``under`` object when given), keeping
    every other key: how results files that several commands share (``results/speed.json``) are extended."""
    path = Path(path)
    data = read_json(path) if path.is_file() else {}
    if under is None:
        data.update(updates)
    else:
        data[under] = {**data.get(under, {}), **updates}
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, data)


def read_json(path: str | Path, what: str = "JSON file") -> dict:
    """Parse a JSON file; a malformed one is a ValueError naming the file and the position."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path} is not valid JSON ({err.msg} at line {err.lineno})") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text ({err.reason})") from err


def find_data_dir() -> Path | None:
    """The evaluation data folder: ``$UNIMAE_DATA``, else ``../shared/data`` beside the project or cwd."""
    candidates = [Path(os.environ["UNIMAE_DATA"])] if os.environ.get("UNIMAE_DATA") else []
    candidates += [Path(__file__).resolve().parents[3] / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    return next((c for c in candidates if c.is_dir()), None)
