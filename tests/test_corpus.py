"""Training-data loading and its error messages."""

import json

import pytest

from unimae.data.corpus import CorpusError, enwiki_gensim_paragraphs, load_texts


def test_txt_jsonl_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\n  \ntwo\n")
    assert load_texts(str(tmp_path / "a.txt")) == ["one", "two"]
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n\n" + json.dumps({"text": "y"}) + "\n")
    assert load_texts(str(tmp_path / "a.jsonl")) == ["x", "y"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p", " ", "q"]}), tmp_path / "a.parquet")
    assert load_texts(str(tmp_path / "a.parquet")) == ["p", "q"]


def test_null_rows_of_a_parquet_file_or_hub_dataset_are_counted_when_dropped(tmp_path, caplog, monkeypatch):
    import sys
    import types

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p", None, "q", None]}), tmp_path / "a.parquet")
    with caplog.at_level("WARNING"):
        assert load_texts(str(tmp_path / "a.parquet")) == ["p", "q"]
    assert "dropped 2 rows" in caplog.text and "'text' is not text" in caplog.text

    class Dataset(dict):  # the parts of datasets.Dataset the loader reads
        column_names = ["body"]

    fake = types.SimpleNamespace(load_dataset=lambda name, split: Dataset(body=["a", None]))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(CorpusError, match=r"has no 'text' column \(columns: \['body'\]\)"):
        load_texts("someone/corpus")
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert load_texts("someone/corpus", field="body") == ["a"]
    assert "dropped 1 rows of someone/corpus" in caplog.text


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nalso fine\nbroken \xff\xfe here\n")
    with pytest.raises(CorpusError, match=r"bad.txt, line 3: invalid UTF-8"):
        load_texts(str(path))


def test_malformed_jsonl_and_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(CorpusError, match="line 2: not valid JSON"):
        load_texts(str(path))
    path.write_text('{"body": "no text field"}\n')
    with pytest.raises(CorpusError, match="line 1: expected an object with a string 'text'"):
        load_texts(str(path))


def test_missing_file_and_empty_corpus(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_texts(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(CorpusError, match="empty"):
        load_texts(str(tmp_path / "empty.txt"))


def test_default_corpus_is_real_wikipedia_split_by_article():
    train = enwiki_gensim_paragraphs("train")
    heldout = enwiki_gensim_paragraphs("heldout")
    assert len(train) > 3000 and len(heldout) > 200
    assert not set(train) & set(heldout)
    assert all(len(p) >= 200 for p in train[:100])
    assert "Anarchism" in train[0]


def test_a_jsonl_corpus_read_on_demand_gives_the_same_passages_and_errors(tmp_path):
    """open_passages on a .jsonl file: PassageFile keeps offsets, not texts, and yields exactly the
    list's passages (ids from the field, else the line number; stripped; empty ones dropped); same errors."""
    from unimae.data.corpus import load_passages
    from unimae.data.passage_file import PassageFile, open_passages

    lines = [
        {"id": "a", "text": " first "},
        {"text": "no id: line 2"},
        {"id": "c", "text": "   "},
        {"id": 7, "text": "é"},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in lines) + "\n\n" + json.dumps({"text": "end"}))
    eager, lazy = load_passages(str(path)), open_passages(str(path))
    assert isinstance(lazy, PassageFile) and not isinstance(eager, PassageFile)
    assert list(lazy) == eager == [("a", "first"), ("2", "no id: line 2"), ("7", "é"), ("6", "end")]
    assert lazy[-1] == ("6", "end") and lazy[1:3] == eager[1:3] and len(lazy) == 4
    with pytest.raises(IndexError):
        lazy[4]

    path.write_text(json.dumps({"id": "x", "text": "one"}) + "\n" + json.dumps({"id": "x", "text": "two"}) + "\n")
    for loaded in (load_passages, open_passages):
        with pytest.raises(CorpusError, match=r"passage id 'x' occurs twice"):
            loaded(str(path))
    path.write_text(json.dumps({"text": " "}) + "\n")
    with pytest.raises(CorpusError, match="the corpus is empty"):
        open_passages(str(path))
    path.write_bytes(b'{"text": "fine"}\n{"text": "broken \xff"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl, line 2: invalid UTF-8"):
        open_passages(str(path))
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(CorpusError, match=r"line 2: expected an object with a string 'text' field"):
        open_passages(str(path))


def test_passage_ids_whose_digests_collide_are_compared_by_id(tmp_path):
    import numpy as np

    from unimae.data.passage_file import PassageFile

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "x", "text": "one"}) + "\n" + json.dumps({"id": "y", "text": "two"}) + "\n")
    passages = PassageFile.open(path)
    passages._check_unique(np.array([5, 5], dtype=np.uint64))  # same digest, different ids: no error
    path.write_text(json.dumps({"id": "x", "text": "one"}) + "\n" + json.dumps({"id": "x", "text": "two"}) + "\n")
    with pytest.raises(CorpusError, match="occurs twice"):
        PassageFile(path, "text", "id", passages.lines)._check_unique(np.array([5, 5], dtype=np.uint64))
