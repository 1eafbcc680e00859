"""`unimae index --engine ray` on a local Ray with 2 workers: the single-process vectors and top-k, resume after a
kill -9, and a passage that makes a worker raise fails the job by its id with nothing half-written.

The jobs that need something injected into the workers (a slow or a failing encoder) run as their own driver in a
subprocess, joined to the test's Ray, with a ``worker_process_setup_hook`` that patches the encoder there."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import SENTENCES

from unimae.cli import main
from unimae.encoder import Encoder
from unimae.retrieval.index import IndexConfig, VectorIndex, VectorIndexError
from unimae.retrieval.ray_index import EncoderLoad, RayConfig, _ray, build_on_ray

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")  # Ray's own settings

CORPUS = [(f"p{i}", f"{SENTENCES[i % 12]} and {SENTENCES[(i // 12 + 5 * i) % 12]}") for i in range(50)]
SAME = ("embedding", "dim", "count", "passages", "precision", "merged", "max_length", "complete")

JOB = """
import json, sys, time
import ray
from unimae.retrieval.index import IndexConfig
from unimae.retrieval.ray_index import EncoderLoad, RayConfig, build_on_ray

def patch_encoder():  # runs in every worker of this job
    from unimae.encoder import Encoder
    original = Encoder.encode_document
    def patched(self, texts, **kwargs):
        if any("BAD ROW" in text for text in texts):
            raise ValueError("this passage breaks the encoder")
        time.sleep(SLEEP)
        return original(self, texts, **kwargs)
    Encoder.encode_document = patched

address, model, corpus, out = sys.argv[1:5]
ray.init(address=address, runtime_env={"worker_process_setup_hook": patch_encoder})
passages = [tuple(p) for p in json.load(open(corpus))]
load = EncoderLoad(model, max_length=64, precision="fp32")
build_on_ray(load, passages, out, IndexConfig(shard_size=5), ray_config=RayConfig(workers=2))
"""


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for the module; -> its address, for the subprocess drivers to join."""
    ray = pytest.importorskip("ray", reason="the Ray engine needs Ray Data: pip install 'unimae[ray]'")
    pytest.importorskip("ray.data", reason="the Ray engine needs Ray Data: pip install 'unimae[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


def _reference(model: str) -> np.ndarray:
    """The corpus embedded by the single-process path: (50, D) fp32 unit rows."""
    encoder = Encoder.from_pretrained(model, precision="fp32", max_length=64)
    return encoder.encode_document([text for _, text in CORPUS], normalize=True, batch_size=16)


def _vectors(directory) -> np.ndarray:
    """All shards of an index folder, in order: (N, D)."""
    return np.concatenate([np.load(p) for p in sorted((directory / "shards").glob("*.npy"))])


def _assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)  # (N,)
    assert cosine.min() >= 0.9999, f"lowest cosine {cosine.min():.6f}"


def _start_job(tmp_path, address: str, model: str, out, sleep: float, corpus=CORPUS) -> subprocess.Popen:
    """``JOB`` as its own driver joined to ``address``; its workers sleep ``sleep`` s per shard."""
    (tmp_path / "job.py").write_text(JOB.replace("SLEEP", str(sleep)))
    (tmp_path / "corpus.json").write_text(json.dumps(corpus))
    command = [sys.executable, str(tmp_path / "job.py"), address, model, str(tmp_path / "corpus.json"), str(out)]
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - the child writes it until it ends
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _assert_whole_shards(shards, dim: int = 64) -> list:
    """Every shard file on disk is a whole (5, dim) array; -> their paths."""
    paths = sorted(shards.glob("*.npy"))
    for path in paths:
        assert np.load(path).shape == (5, dim), f"{path.name} is half-written"
    return paths


def test_without_ray_the_engine_names_the_extra(monkeypatch, corpus_file, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'unimae\[ray\]'"):
        _ray()
    args = ["index", "--engine", "ray", "--corpus", str(corpus_file), "--output-dir", str(tmp_path / "idx")]
    assert main(args) == 2 and "pip install 'unimae[ray]'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="workers"):
        RayConfig(workers=0)
    with pytest.raises(ValueError, match="passages_per_job"):
        RayConfig(passages_per_job=0)


@pytest.mark.slow
def test_ray_engine_gives_the_single_process_vectors_and_top_k(local_ray, tiny_llama, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": pid, "text": text}) + "\n" for pid, text in CORPUS))
    encoder = Encoder.from_pretrained(tiny_llama, precision="fp32", max_length=64)
    here = VectorIndex.build(encoder, CORPUS, tmp_path / "here", IndexConfig(shard_size=8))
    args = ["index", "--model", tiny_llama, "--corpus", str(corpus), "--precision", "fp32", "--max-length", "64"]
    args += ["--shard-size", "8", "--engine", "ray", "--workers", "2", "--output-dir", str(tmp_path / "ray")]
    assert main(args) == 0, capsys.readouterr().err
    on_ray = VectorIndex.load(tmp_path / "ray")
    assert {k: on_ray.manifest[k] for k in SAME} == {k: here.manifest[k] for k in SAME}
    _assert_same_vectors(_vectors(tmp_path / "ray"), _vectors(tmp_path / "here"))
    queries = encoder.encode([text for _, text in CORPUS[::5]], normalize=True)  # (10, D)
    top = [[h.id for h in hits] for hits in here.search(queries, k=5)]
    assert [[h.id for h in hits] for hits in on_ray.search(queries, k=5)] == top

    shutil.copytree(tmp_path / "ray", tmp_path / "disk")  # every shard there: no worker embeds again
    assert main([*args[:-1], str(tmp_path / "disk"), "--store", "disk"]) == 0, capsys.readouterr().err
    from unimae.retrieval.disk_index import DiskIndex, open_index

    disk = open_index(tmp_path / "disk")
    assert isinstance(disk, DiskIndex)
    assert [[h.id for h in hits] for hits in disk.search(queries, k=5)] == top


@pytest.mark.slow
def test_ray_build_killed_mid_run_resumes(local_ray, tiny_llama, tmp_path):
    out = tmp_path / "idx"
    job = _start_job(tmp_path, local_ray, tiny_llama, out, sleep=1.0)
    deadline = time.monotonic() + 240
    try:
        while len(list((out / "shards").glob("*.npy"))) < 2:
            assert job.poll() is None, f"the job ended before it was killed:\n{(tmp_path / 'job.log').read_text()}"
            assert time.monotonic() < deadline, f"no shard after 240 s:\n{(tmp_path / 'job.log').read_text()}"
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # kill -9 the driver (the job's workers die with it)
        job.wait()
    finished = _assert_whole_shards(out / "shards")
    assert 2 <= len(finished) < 10 and not json.loads((out / "manifest.json").read_text())["complete"]
    damaged, kept = finished[0], finished[1:]
    damaged.write_bytes(b"not a numpy file")
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept}

    load = EncoderLoad(tiny_llama, max_length=64, precision="fp32")
    index = build_on_ray(load, CORPUS, out, IndexConfig(shard_size=5), ray_config=RayConfig(workers=2))
    assert len(index) == 50 and index.manifest["complete"]
    # built from Python without source=: the manifest still names the model and (no) adapter, as an Encoder's does
    assert index.manifest["model"] == os.path.realpath(tiny_llama) and index.manifest["adapter_revision"] == "base"
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept} == stamps, "finished shards are not redone"
    _assert_same_vectors(_vectors(out), _reference(tiny_llama))  # the damaged and the missing shards redone


@pytest.mark.slow
def test_the_driver_reads_the_texts_one_job_at_a_time(local_ray, tiny_llama, tmp_path, monkeypatch):
    """Before: the driver gathered the texts of every missing shard before the one Ray Data job started."""
    import unimae.retrieval.ray_index as ray_index

    read, held = [], []
    shard_row, write = ray_index._shard_row, ray_index.write_shard
    monkeypatch.setattr(ray_index, "_shard_row", lambda *args: read.append(args[1]) or shard_row(*args))

    def watched(shards, start, vectors):  # the shards read so far, against the shards written before this one
        held.append((len(read), len(held)))
        write(shards, start, vectors)

    monkeypatch.setattr(ray_index, "write_shard", watched)
    load = EncoderLoad(tiny_llama, max_length=64, precision="fp32")
    config = RayConfig(workers=2, passages_per_job=27)  # 27 passages: 5 shards of 5 a job, 2 jobs
    index = build_on_ray(load, CORPUS, tmp_path / "idx", IndexConfig(shard_size=5), ray_config=config)
    assert len(index) == 50 and len(held) == 10
    assert all(sliced <= (written // 5 + 1) * 5 for sliced, written in held), held
    _assert_same_vectors(_vectors(tmp_path / "idx"), _reference(tiny_llama))


@pytest.mark.slow
def test_a_passage_that_breaks_a_worker_fails_the_job_by_its_id(local_ray, tiny_llama, tmp_path):
    corpus = [(pid, "BAD ROW " + text if pid == "p23" else text) for pid, text in CORPUS]
    out = tmp_path / "idx"
    job = _start_job(tmp_path, local_ray, tiny_llama, out, sleep=0, corpus=corpus)
    assert job.wait(timeout=300) != 0
    log = (tmp_path / "job.log").read_text()
    assert "VectorIndexError: passage 'p23' cannot be embedded" in log and "breaks the encoder" in log, log[-3000:]
    shards = _assert_whole_shards(out / "shards")
    assert "00000020.npy" not in {p.name for p in shards}, "the failing shard is not written"
    assert not json.loads((out / "manifest.json").read_text())["complete"] and not (out / "index.faiss").exists()
    with pytest.raises(VectorIndexError, match="incomplete"):
        VectorIndex.load(out)


@pytest.mark.slow
def test_a_worker_that_cannot_start_ends_the_job_with_one_clear_error(local_ray, tiny_llama, tmp_path, monkeypatch):
    """Before: the RayActorError (with Ray's traceback) reached the command line raw."""
    import unimae.retrieval.ray_index as ray_index

    facts = ray_index.worker_facts
    monkeypatch.setattr(ray_index, "worker_facts", lambda *args: {**facts(*args), "max_length": 63})  # as a GPU node
    load = EncoderLoad(tiny_llama, max_length=64, precision="fp32")
    with pytest.raises(VectorIndexError, match=r"the Ray job failed \(RuntimeError: this worker's encoder embeds as"):
        build_on_ray(load, CORPUS[:20], tmp_path / "idx", IndexConfig(shard_size=5), ray_config=RayConfig(workers=2))


def test_gpus_the_cluster_lacks_are_an_error_on_a_local_ray_and_a_warning_on_a_cluster(caplog):
    """Before: a local Ray asked for GPUs it does not have waited forever for them."""
    from types import SimpleNamespace

    from unimae.retrieval.ray_index import check_resources

    cpu_only = SimpleNamespace(cluster_resources=lambda: {"CPU": 2.0})
    with pytest.raises(VectorIndexError, match="has 0 GPUs.*--num-gpus-per-worker 0"):
        check_resources(cpu_only, RayConfig(num_gpus_per_worker=1), local=True)
    with caplog.at_level("WARNING"):
        check_resources(cpu_only, RayConfig(num_gpus_per_worker=1), local=False)  # an autoscaler may add them
        check_resources(cpu_only, RayConfig(), local=True)
    assert caplog.text.count("waits until nodes with GPUs join") == 1
