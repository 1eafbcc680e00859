"""Small file helpers shared by every writer: atomic writes, write failures, hashes and the evaluation-data folder.

An atomic write goes to a hidden temporary file in the same folder and is renamed into place, so a
reader (or a run killed half-way) sees either the old file or the new one, never a torn one. Surviving a power
cut as well takes ``fsync=True`` (the file's bytes reach the disk before the rename) and :func:`fsync_folder`
after the renames a later write vouches for (a manifest saying a build is complete). A write that
fails (a full disk) deletes what it had half written and says which file it could not write
(:func:`writing`), whatever library raised it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}

logger = logging.getLogger(__name__)
_NO_FOLDER_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}  # file systems that cannot fsync a folder


def atomic_write(path: str | Path, write: Callable[[Path], object], fsync: bool = False) -> Path:
    """Call ``write(tmp)`` to fill a temporary file, then rename it to ``path``. ``fsync``: flush the file to disk
    before the rename (one fsync a file), so that after a power cut ``path`` is the old file or the whole new one;
    the rename itself lasts once its folder is synced (:func:`fsync_folder`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with writing(path, partial=tmp):
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as handle:  # whoever wrote tmp closed it; any handle flushes the same file
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    return path


def fsync_folder(folder: str | Path) -> None:
    """Make the renames into ``folder`` last through a power cut (fsync its entries); nothing where a folder cannot
    be opened (Windows) or its file system cannot sync one (EINVAL/ENOTSUP on some network and FUSE mounts, as
    SQLite tolerates): the renames stay atomic there, only not durable."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_FOLDER_SYNC:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing(target: str | Path, partial: str | Path | None = None) -> Iterator[None]:
    """Wrap the writing of ``target``: on any failure delete ``partial`` (the temporary file or folder being
    filled), and turn a failed write (a full disk; a library's own write error, which names no errno) into an
    OSError naming ``target``. Other errors pass through unchanged."""
    try:
        yield
    except BaseException as err:
        if partial is not None:
            remove(partial)
        if _is_write_error(err):
            raise OSError(_write_message(target, err)) from err
        raise


def _is_write_error(err: BaseException) -> bool:
    """An OSError of a failed write (full disk, quota, read-only), safetensors' SafetensorError or a RuntimeError
    of torch's file writer ("[enforce fail at inline_container.cc] ... file write failed" or "unexpected pos") or
    of FAISS ("write error in ... (No space left on device)")."""
    if isinstance(err, OSError):
        return err.errno in _WRITE_ERRNOS
    text = str(err).lower()
    library = isinstance(err, RuntimeError) or type(err).__name__ == "SafetensorError"
    return library and any(sign in text for sign in ("writ", "space left", "inline_container"))


def _write_message(target: str | Path, err: BaseException) -> str:
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "space left" in str(err).lower()
    why = "the disk is full" if full else (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"could not write {target}: {why}; free some space (or choose another folder) and run the command again"


def remove(path: str | Path) -> None:
    """Delete a file or a folder tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_folder(partial: str | Path, out: str | Path) -> None:
    """The filled folder ``partial`` becomes ``out``: an older ``out`` is moved aside first and deleted last, so an
    interruption leaves one of the two whole (an aside copy left with no ``out`` is restored by the next call)."""
    partial, out = Path(partial), Path(out)
    aside = out.with_name(f".{out.name}.old")
    if aside.exists() and not out.exists():
        aside.rename(out)  # an earlier call stopped between its two renames
    remove(aside)
    if out.exists():
        out.rename(aside)
    partial.rename(out)
    remove(aside)


def check_writable(folder: str | Path, flag: str = "--output") -> None:
    """Write (then delete) a probe file in ``folder``, or in the nearest folder above it that exists (where it
    would be created), so that a read-only or impossible destination fails before minutes of work, not after;
    an OSError naming ``flag`` and the folder. Creates nothing."""
    folder = Path(folder).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".unimae-probe-"):
            pass
    except OSError as err:
        raise OSError(
            f"cannot write to {folder} ({err.strerror or err}); choose another {flag} in a folder you can write"
        ) from err


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def atomic_write_text(path: str | Path, text: str, fsync: bool = False) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), fsync)


def atomic_write_json(path: str | Path, payload, fsync: bool = False) -> Path:
    """JSON with indent 2 and a final newline; objects JSON cannot hold are written as str()."""
    return atomic_write_text(path, json.dumps(payload, indent=2, default=str) + "\n", fsync)


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


def read_log_lines(path: str | Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a JSON-lines log that holds a JSON object; a line cut off by a crash or a
    full disk is dropped with a warning, blank lines silently; [] without the file."""
    path = Path(path)
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            record = False
        if isinstance(record, dict):
            kept.append((line, record))
        elif record is not None:
            logger.warning("%s: dropping an unreadable log line: %.60s", path, line)
    return kept


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
