"""A .jsonl corpus read on demand: the (id, text) passages of a file larger than RAM.

:func:`unimae.data.corpus.load_passages` gives a list: every text in memory (the file's size plus about 160
bytes of Python objects a passage). A disk index (``unimae index --store disk``) needs each passage only twice,
in order (its fingerprint and its copy into the index folder), plus one shard of texts at a time to embed, so
:class:`PassageFile` keeps three integers a passage instead: the byte offsets of its line and its line number
(24 bytes; 2.4 GB at 100 M passages). One validating pass at :meth:`PassageFile.open` applies the rules of
``load_passages`` (UTF-8, one JSON object a line with a string text field, empty texts dropped, unique ids) with
the same errors, the file and line named.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import operator
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from unimae.data.corpus import CorpusError, duplicate_id, jsonl_records_at, load_passages, passage_id


class MappedRecords(Sequence):
    """A file's records read on demand through a read-only memory map: subclasses give ``__len__`` and
    ``_read(i)`` (the record at a valid index); indexing (negative indices, slices, bounds) is here."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def _read(self, i: int):
        raise NotImplementedError

    def __getitem__(self, item):
        if isinstance(item, slice):
            return [self[i] for i in range(*item.indices(len(self)))]
        i = operator.index(item)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"passage {item} of {len(self)}")
        return self._read(i)


class PassageFile(MappedRecords):
    """(id, text) passages of a .jsonl file, each parsed when read; ids from ``id_field`` (else the line number)
    and texts stripped, as :func:`~unimae.data.corpus.load_passages` gives them. The file must not change while
    it is in use."""

    def __init__(self, path: Path, field: str, id_field: str, lines: np.ndarray):
        super().__init__(path)
        self.field, self.id_field = field, id_field
        self.lines = lines  # (N, 3) int64: line number, start byte, end byte

    @classmethod
    def open(cls, path: str | Path, field: str = "text", id_field: str = "id") -> PassageFile:
        """Scan ``path`` once: validate every line, keep where each usable passage is; CorpusError for a bad
        line (named), an empty corpus or an id that occurs twice."""
        path = Path(path)
        rows, digests = array("q"), array("Q")
        size = path.stat().st_size
        with tqdm(total=size, desc=f"scanning {path.name}", unit="B", unit_scale=True, disable=size < 1 << 26) as bar:
            for number, start, end, record in jsonl_records_at(path, field):
                if record[field].strip():
                    pid = passage_id(record, id_field, number)
                    rows.extend((number, start, end))
                    digests.append(int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "little"))
                bar.update(end - bar.n)
        if not digests:
            raise CorpusError(f"no usable text in {path}: the corpus is empty")
        lines = np.frombuffer(rows, dtype=np.int64).reshape(-1, 3).copy()  # (N, 3)
        passages = cls(path, field, id_field, lines)
        passages._check_unique(np.frombuffer(digests, dtype=np.uint64))
        return passages

    def _check_unique(self, digests: np.ndarray) -> None:
        """Passages whose id digests collide (N,) are compared by id: a real repeat is a CorpusError."""
        order = np.argsort(digests, kind="stable")  # (N,)
        ranked = digests[order]  # (N,)
        same = np.flatnonzero(ranked[1:] == ranked[:-1])  # positions i where i and i + 1 collide
        for i in same:
            first, second = self[int(order[i])][0], self[int(order[i + 1])][0]
            if first == second:
                raise duplicate_id(self.path, first)

    def __len__(self) -> int:
        return len(self.lines)

    def _read(self, i: int) -> tuple[str, str]:
        number, start, end = (int(v) for v in self.lines[i])
        record = json.loads(self._map[start:end])
        return passage_id(record, self.id_field, number), record[self.field].strip()


def open_passages(data: str, field: str = "text", id_field: str = "id") -> Sequence[tuple[str, str]]:
    """The passages of ``data`` as :func:`~unimae.data.corpus.load_passages` gives them, a .jsonl file read on
    demand (:class:`PassageFile`), any other source loaded as a list."""
    path = Path(data).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        return PassageFile.open(path, field, id_field)
    return load_passages(data, field, id_field)
