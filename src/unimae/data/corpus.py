"""Training text: the default offline corpus and the user's own files.

Default corpus ``enwiki-gensim``: the shortened English Wikipedia dump that ships inside the
gensim wheel (``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-
shortened.bz2``, 206 articles). We extract article text with gensim's own wiki parser
(``extract_pages`` + ``filter_wiki``) and keep prose paragraphs of >= 200 characters: about 4,600
paragraphs, 2.6 M characters. The paper trains on "randomly selected wiki-text", so real
Wikipedia prose is the closest thing available without the Hub.

``--data`` also takes a ``.txt`` file (one text per non-empty line), ``.jsonl`` (a ``text``
field per line), ``.parquet`` (a ``text`` column), or a Hugging Face datasets name (online).
"""

from __future__ import annotations

import bz2
import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "enwiki-gensim"
_ENWIKI = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_MIN_PARAGRAPH_CHARS = 200


class CorpusError(ValueError):
    """The training data cannot be used; the message names the file and line."""


def enwiki_gensim_paragraphs(split: str = "train", min_chars: int = _MIN_PARAGRAPH_CHARS) -> list[str]:
    """Prose paragraphs of the Wikipedia articles shipped in the gensim wheel.

    Split by article: every 10th article (by position in the dump) is held out ("heldout") and
    never used for training ("train"), so checks on held-out text measure unseen articles.
    """
    return [text for _, text in enwiki_gensim_passages(split, min_chars)]


def enwiki_gensim_passages(split: str = "train", min_chars: int = _MIN_PARAGRAPH_CHARS) -> list[tuple[str, str]]:
    """(id, paragraph) pairs of :func:`enwiki_gensim_paragraphs`; the id is ``"<article title>#<n>"``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    try:
        import gensim
        from gensim.corpora.wikicorpus import extract_pages, filter_wiki
    except ImportError as err:
        raise CorpusError(
            "the default corpus needs gensim: pip install 'gensim>=4.3' (or pass --data with your own text)"
        ) from err
    dump = Path(gensim.__file__).parent / _ENWIKI
    paragraphs = []
    with bz2.open(dump) as handle:
        for article, (title, text, _pageid) in enumerate(extract_pages(handle)):
            if (article % 10 == 9) != (split == "heldout"):
                continue
            kept = 0
            for para in filter_wiki(text).split("\n"):
                para = re.sub(r"'{2,}", "", para).strip()  # leftover bold/italic quote markup
                if len(para) >= min_chars and para[-1] in ".!?\"'":
                    kept += 1
                    paragraphs.append((f"{title}#{kept}", para))
    return paragraphs


def _lines(path: Path):
    """Yield (line number, decoded line), with a clear error on invalid UTF-8."""
    for number, _start, _end, line in _lines_at(path):
        yield number, line


def _lines_at(path: Path):
    """Yield (line number, byte offsets of the line's start and end, decoded line), with a clear error on invalid
    UTF-8."""
    start = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, start, start + len(raw), raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CorpusError(
                    f"{path}, line {number}: invalid UTF-8 ({err.reason} at byte {err.start}); "
                    "re-encode the file as UTF-8"
                ) from err
            start += len(raw)


def _read_jsonl(path: Path, field: str) -> list[str]:
    return [record[field] for _, record in jsonl_records(path, field)]


def jsonl_records(path: Path, field: str, text_fields: tuple[str, ...] = ()):
    """Yield (line number, record) for each non-empty line; each record must have a string ``field``, and
    ``text_fields`` that it has must hold text too (no lone surrogate)."""
    for number, _start, _end, record in jsonl_records_at(path, field, text_fields):
        yield number, record


def jsonl_records_at(path: Path, field: str, text_fields: tuple[str, ...] = ()):
    """:func:`jsonl_records` with where each line is: (line number, start byte, end byte, record)."""
    for number, start, end, line in _lines_at(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}, line {number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise CorpusError(f"{path}, line {number}: expected an object with a string {field!r} field")
        for name in (field, *text_fields):
            try:
                value = record.get(name)
                if isinstance(value, str):
                    value.encode("utf-8")
            except UnicodeEncodeError as err:  # a JSON \\ud800 escape: not text
                raise CorpusError(f"{path}, line {number}: {name!r} holds a lone surrogate ({err.reason})") from err
        yield number, start, end, record


def _read_parquet(path: Path, field: str) -> list[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if field not in table.column_names:
        raise CorpusError(f"{path} has no {field!r} column (columns: {table.column_names})")
    return _strings(table.column(field).to_pylist(), path, field)


def _strings(values: list, source, field: str) -> list:
    """The string values of a column; the rest (nulls, numbers) dropped with a warning that counts them."""
    kept = [t for t in values if isinstance(t, str)]
    if len(kept) < len(values):
        logger.warning(
            "dropped %d rows of %s whose %r is not text (null or another type)", len(values) - len(kept), source, field
        )
    return kept


def _read_hub(name: str, field: str) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise CorpusError(
            f"{name!r} is not a file; to use a Hugging Face dataset install `datasets` "
            "(and be online), or pass a .txt/.jsonl/.parquet file"
        ) from err
    try:
        dataset = datasets.load_dataset(name, split="train")
    except Exception as err:  # noqa: BLE001 - the datasets library raises many types offline
        raise CorpusError(
            f"could not load Hugging Face dataset {name!r}: {err}. Offline? Pass a local "
            ".txt/.jsonl/.parquet file instead"
        ) from err
    if field not in dataset.column_names:
        raise CorpusError(f"Hugging Face dataset {name!r} has no {field!r} column (columns: {dataset.column_names})")
    return _strings(dataset[field], name, field)


def load_texts(data: str = DEFAULT_CORPUS, field: str = "text", keep_empty: bool = False) -> list[str]:
    """Load training texts, without outer whitespace; drops empty and whitespace-only ones (``keep_empty``:
    keeps them, one text per line or row, as ``unimae embed`` needs); errors on an empty result."""
    path = Path(data).expanduser()
    if data == DEFAULT_CORPUS:
        texts = enwiki_gensim_paragraphs()
    elif path.suffix == ".txt" and path.is_file():
        texts = [line for _, line in _lines(path)]
    elif path.suffix == ".jsonl" and path.is_file():
        texts = _read_jsonl(path, field)
    elif path.suffix == ".parquet" and path.is_file():
        texts = _read_parquet(path, field)
    elif path.suffix in (".txt", ".jsonl", ".parquet") or path.exists() or data.startswith((".", "/", "~")):
        if path.exists():
            raise CorpusError(f"{path}: unsupported data file; use .txt, .jsonl or .parquet")
        raise CorpusError(f"data file {path} does not exist")
    else:
        texts = _read_hub(data, field)
    kept = [t.strip() for t in texts if keep_empty or t.strip()]
    if len(kept) < len(texts):
        logger.warning("dropped %d empty or whitespace-only texts from %s", len(texts) - len(kept), data)
    if not kept:
        raise CorpusError(f"no usable text in {data}: the corpus is empty")
    return kept


def load_passages(data: str = DEFAULT_CORPUS, field: str = "text", id_field: str = "id") -> list[tuple[str, str]]:
    """(id, text) passages to index for retrieval.

    ``enwiki-gensim`` (or ``enwiki-gensim:heldout`` / ``:train``) gives ``"<title>#<n>"`` ids; a .jsonl
    file takes ids from ``id_field`` where present (else the line number); other sources number the texts.
    Empty texts are dropped; duplicate ids are an error. A .jsonl file read on demand instead:
    :func:`unimae.data.passage_file.open_passages`.
    """
    name, _, split = data.partition(":")
    path = Path(data).expanduser()
    if name == DEFAULT_CORPUS and not path.exists():
        passages = enwiki_gensim_passages(split or "train")
    elif path.suffix == ".jsonl" and path.is_file():
        records = jsonl_records(path, field)
        passages = [(passage_id(record, id_field, number), record[field]) for number, record in records]
    else:
        passages = [(str(i), text) for i, text in enumerate(load_texts(data, field))]
    passages = [(pid, text.strip()) for pid, text in passages if text.strip()]
    if not passages:
        raise CorpusError(f"no usable text in {data}: the corpus is empty")
    seen: set[str] = set()
    for pid, _ in passages:
        if pid in seen:
            raise duplicate_id(data, pid)
        seen.add(pid)
    return passages


def passage_id(record: dict, id_field: str, number: int) -> str:
    """A .jsonl passage's id: its ``id_field``, else its line number."""
    return str(record.get(id_field, number))


def duplicate_id(data, pid: str) -> CorpusError:
    return CorpusError(f"{data}: passage id {pid!r} occurs twice; ids must be unique")
