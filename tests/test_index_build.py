"""Index builds that a power cut or a second build cannot leave claiming to be complete: every renamed file is
fsynced before the manifest says ``complete``, and one build at a time holds the folder's lock (readers take none).
Both stores; a table encoder stands in for the model (the build reads only its embedding facts)."""

import contextlib
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from unimae import files
from unimae.embedding.spec import EmbeddingSpec
from unimae.retrieval.disk_index import DiskIndex, DiskIndexConfig, open_index
from unimae.retrieval.index import LOCK_FILE, IndexConfig, VectorIndex, VectorIndexError, build_lock

needs_flock = pytest.mark.skipif(sys.platform == "win32", reason="the test checks the lock with fcntl (POSIX)")

STORES = {
    "flat": (VectorIndex, IndexConfig(shard_size=4)),
    "binary-int8": (VectorIndex, IndexConfig(kind="binary", shard_size=4)),
    "disk": (DiskIndex, DiskIndexConfig(shard_size=4, target_recall=0)),
}
STORE_FILES = {
    "flat": ["index.faiss"],
    "binary-int8": ["index.faiss", "rescore.faiss", "rescore.npy"],
    "disk": ["vectors.npy", "ivfpq.faiss", "passages.offsets.npy"],
}


class TableEncoder:
    """The parts of an Encoder an index build reads; passage "v<i>" embeds as row i of a fixed random table.
    ``during`` (if set) is called at each shard, while the build runs."""

    def __init__(self, n: int = 10, dim: int = 16):
        rows = np.random.default_rng(0).standard_normal((n, dim))  # (n, D)
        self.vectors = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
        self.spec, self.max_length, self.precision, self.adapter_merged = EmbeddingSpec(), 64, "fp32", False
        self.embedding_dim, self.during = dim, None

    def encode_document(self, texts, **kwargs) -> np.ndarray:
        if self.during is not None:
            self.during()
        return self.vectors[[int(t[1:]) for t in texts]]  # (n, D)


def passages(n: int = 10) -> list[tuple[str, str]]:
    return [(f"s{i}", f"v{i}") for i in range(n)]


@contextlib.contextmanager
def held_by_another_process(directory):
    """The folder's build lock held, for the block, by a child process (as a running `unimae index` holds it)."""
    directory.mkdir(parents=True, exist_ok=True)
    code = (
        "import sys; from unimae.retrieval.index import build_lock; lock = build_lock(sys.argv[1]); "
        "lock.__enter__(); print('locked', flush=True); sys.stdin.read()"
    )
    command = [sys.executable, "-c", code, str(directory)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        yield
    finally:
        child.stdin.close()  # the child's read ends, it exits, its lock goes with it
        child.wait(timeout=60)


def lock_is_free(directory) -> bool:
    """Whether a new open file description (another build's) could take the folder's lock now."""
    import fcntl

    with open(directory / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


@needs_flock
@pytest.mark.parametrize("store", sorted(STORES))
def test_a_second_build_fails_at_once_naming_the_folder_and_overwrite_deletes_nothing(tmp_path, store):
    cls, config = STORES[store]
    out = tmp_path / "idx"
    cls.build(TableEncoder(), passages(), out, config)
    before = {path.name: path.read_bytes() for path in (out / "shards").iterdir()}
    with held_by_another_process(out):
        for overwrite in (False, True):
            with pytest.raises(VectorIndexError, match=r"another `unimae index` build holds") as err:
                cls.build(TableEncoder(), passages(8), out, config, overwrite=overwrite)
            assert str(out) in str(err.value) and "--output-dir" in str(err.value)
    assert {path.name: path.read_bytes() for path in (out / "shards").iterdir()} == before, "no shard deleted"
    assert open_index(out).manifest["count"] == 10


@needs_flock
@pytest.mark.parametrize("store", sorted(STORES))
def test_the_lock_is_held_while_building_and_released_after_an_error(tmp_path, store):
    cls, config = STORES[store]
    out, seen = tmp_path / "idx", []
    encoder = TableEncoder()
    encoder.during = lambda: seen.append(lock_is_free(out))
    cls.build(encoder, passages(), out, config)
    assert seen == [False, False, False] and lock_is_free(out), "held at every shard, released after"

    broken = TableEncoder()
    broken.vectors[:] = np.nan
    with pytest.raises(VectorIndexError, match="NaN"):
        cls.build(broken, passages(), tmp_path / "broken", config)
    assert lock_is_free(tmp_path / "broken")
    cls.build(TableEncoder(), passages(), tmp_path / "broken", config)  # the next build goes ahead


@needs_flock
def test_a_held_lock_does_not_block_opening_or_searching_a_finished_index(tmp_path):
    encoder = TableEncoder()
    for store in ("flat", "disk"):
        cls, config = STORES[store]
        cls.build(encoder, passages(), tmp_path / store, config)
        with held_by_another_process(tmp_path / store):
            hits = open_index(tmp_path / store).search(encoder.vectors[3:4], k=1)
        assert hits[0][0].id == "s3"


@needs_flock
def test_unimae_index_on_a_folder_another_build_holds_is_a_clear_error(tiny_model_dirs, corpus_file, tmp_path, capsys):
    from unimae.cli import main

    out = tmp_path / "idx"
    command = ["index", "--model", str(tiny_model_dirs["llama"]), "--corpus", str(corpus_file)]
    command += ["--output-dir", str(out), "--precision", "fp32", "--overwrite"]
    with held_by_another_process(out):
        assert main(command) == 2
    error = capsys.readouterr().err
    assert f"index: error: another `unimae index` build holds the index folder {out}" in error
    assert not (out / "manifest.json").exists()
    assert main(command) == 0, "the folder builds once the other build is gone"


@needs_flock
def test_the_lock_is_reentrant_in_its_thread_only(tmp_path):
    """A caller may hold it across two builds (the Ray engine's plan, embed, build); another thread may not build."""
    out, errors = tmp_path / "idx", []

    def build_in_another_thread():
        try:
            VectorIndex.build(TableEncoder(), passages(), out, IndexConfig(shard_size=4))
        except VectorIndexError as err:
            errors.append(str(err))

    with build_lock(out):
        VectorIndex.build(TableEncoder(), passages(), out, IndexConfig(shard_size=4))
        assert not lock_is_free(out), "the inner build left the outer lock held"
        thread = threading.Thread(target=build_in_another_thread)
        thread.start()
        thread.join(timeout=60)
    assert len(errors) == 1 and "holds the index folder" in errors[0]
    assert lock_is_free(out)


@pytest.fixture
def fsynced(monkeypatch) -> list[tuple[int, int]]:
    """(device, inode) of every file and folder os.fsync is called on, in order (a rename keeps the inode, so a
    temporary file's is its final name's)."""
    calls = []
    real = os.fsync

    def record(fd):
        info = os.fstat(fd)
        calls.append((info.st_dev, info.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def inode(path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


@pytest.mark.parametrize("store", sorted(STORES))
def test_every_file_is_fsynced_once_and_its_folder_before_the_complete_manifest(tmp_path, store, fsynced):
    cls, config = STORES[store]
    out = tmp_path / "idx"
    cls.build(TableEncoder(), passages(), out, config)
    written = [p for p in [*out.iterdir(), *(out / "shards").iterdir()] if p.is_file() and p.name != LOCK_FILE]
    assert {p.name for p in written} == {
        *[f"0000000{start}.{ext}" for start in (0, 4, 8) for ext in ("npy", "sha256")],
        *["manifest.json", "passages.jsonl", *STORE_FILES[store]],
    }
    for path in written:
        assert fsynced.count(inode(path)) == 1, f"{path.name} is fsynced once (before its rename)"
    manifest = fsynced.index(inode(out / "manifest.json"))
    for folder in (out, out / "shards"):
        assert inode(folder) in fsynced[:manifest], f"{folder.name}/ synced before the complete manifest"
    assert inode(out) in fsynced[manifest + 1 :], "the complete manifest's rename synced too"
    for path in written:
        if path.name != "manifest.json":
            assert fsynced.index(inode(path)) < manifest


def test_atomic_write_fsyncs_only_when_asked(tmp_path, fsynced):
    """Other writers (evaluation results, exports) keep writing as before, without fsync."""
    files.atomic_write_text(tmp_path / "plain.txt", "a")
    assert fsynced == []
    files.atomic_write_json(tmp_path / "durable.json", {"a": 1}, fsync=True)
    files.fsync_folder(tmp_path)
    assert fsynced == [inode(tmp_path / "durable.json"), inode(tmp_path)]
