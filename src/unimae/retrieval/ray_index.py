"""Embed a corpus on Ray: Ray Data hands shards to an actor pool of Encoders; the driver writes them.

``unimae index --engine ray`` builds the same folder as the single-process path (:mod:`unimae.retrieval.index`, or
:mod:`unimae.retrieval.disk_index` with ``--store disk``): the same shards, manifest, resume rules and index. Only who
embeds the missing shards changes:

1. a Ray task with a worker's resources loads the encoder once and reports what the manifest records of it
   (pooling and spec, max length, resolved precision, LoRA merge, dimension): on a GPU worker ``--precision
   auto`` resolves to bf16 even when the driver has no GPU;
2. the store's own ``build`` runs with a stand-in for that encoder: it checks the folder (resume, or refuse one
   built another way), writes the manifest and passages, and stops at the first shard it would embed;
3. Ray Data embeds every missing shard: one row per shard (first passage, ids, texts), ``map_batches`` over an
   ``ActorPoolStrategy(size=workers)`` of :class:`ShardEmbedder` actors (one ``Encoder.from_pretrained`` per
   actor, ``num_gpus_per_worker`` GPUs each), each shard embedded as
   :func:`unimae.retrieval.index.embed_missing_shards_here` does it (``encode_document(texts, normalize=True,
   dimensions=..., batch_size=...)``). Its vectors come back to
   the driver, which writes the shard atomically with its SHA-256 (:func:`unimae.retrieval.index.write_shard`): a
   shard is on disk whole or not at all. The rows go in jobs of ``passages_per_job`` passages, one after the
   other, each read from the corpus when its job starts: beyond the corpus itself (in RAM for the memory store;
   read on demand for the disk store's ``.jsonl``, :class:`~unimae.data.passage_file.PassageFile`), the driver
   holds one job's texts, at the price of loading the workers' encoders once a job;
4. ``build`` runs again, finds every shard, and builds the index.

Ray does the scheduling, the actor restarts and task retries after a lost worker or node, and the data
movement (its object store); nothing here distributes work by hand. A passage that makes its worker raise is
not retried (an application error would fail again): the worker finds the passage and reports it with the shard,
the driver stops the job with a :class:`~unimae.retrieval.index.VectorIndexError` naming the passage id, the shards
finished before it stay, and a rerun resumes after the fix. Without an ``address`` (or ``$RAY_ADDRESS``) a local
Ray starts with ``workers * num_cpus_per_worker`` CPUs, so one command runs on a laptop and on a cluster
(``address="auto"`` or ``ray://head:10001``), where every worker must reach the model and the adapter by the paths
given (made absolute; the driver alone writes the folder).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from unimae.adapter import load_record
from unimae.embedding.spec import EmbeddingSpec
from unimae.encoder import Encoder
from unimae.release import resolve_adapter
from unimae.retrieval.disk_index import DiskIndex, DiskIndexConfig
from unimae.retrieval.index import IndexConfig, VectorIndex, VectorIndexError, _shard_ok, build_lock, write_shard

logger = logging.getLogger(__name__)


def _ray():
    try:
        import ray
        import ray.data
    except ImportError as err:
        raise ImportError("`unimae index --engine ray` needs Ray Data: pip install 'unimae[ray]'") from err
    return ray


@dataclass
class RayConfig:
    """Where and how wide the Ray job runs."""

    address: str | None = field(
        default=None, metadata={"help": "Ray cluster to join ('auto', 'ray://head:10001'); default: start a local Ray."}
    )
    workers: int = field(default=2, metadata={"help": "Encoder actors (one model each)."})
    num_gpus_per_worker: float = field(default=0, metadata={"help": "GPUs per actor (0: CPU workers)."})
    num_cpus_per_worker: float = field(default=1, metadata={"help": "CPUs per actor (its torch threads)."})
    passages_per_job: int = field(
        default=100_000,
        metadata={
            "help": "Missing passages (rounded to whole shards) handed to one Ray Data job: the texts the driver "
            "sends at a time (about 100 MB of 1 KB passages; with the disk store it holds no more of the corpus); "
            "each job loads every worker's encoder again, so raise it where that load is long against a job's "
            "embedding (GPUs, many workers)."
        },
    )
    runtime_env: dict | None = field(
        default=None,
        metadata={"help": "Ray runtime environment of the job (env vars, pip, a setup hook), if this call starts Ray."},
    )

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.num_gpus_per_worker < 0 or self.num_cpus_per_worker <= 0:
            raise ValueError("num_gpus_per_worker must be >= 0 and num_cpus_per_worker > 0")
        if self.passages_per_job < 1:
            raise ValueError(f"passages_per_job must be >= 1, got {self.passages_per_job}")


@dataclass
class EncoderLoad:
    """How every worker loads its encoder: the arguments of ``Encoder.from_pretrained``."""

    model: str
    adapter: str | None = None
    max_length: int = 512
    precision: str = "auto"
    device: str = "auto"  # auto: the GPU Ray gave the worker (--num-gpus-per-worker), else its CPU

    def __post_init__(self):
        """Local paths made absolute (and a release name its folder): a worker's working directory is Ray's."""
        if self.adapter:
            self.adapter = str(Path(resolve_adapter(self.adapter)).resolve())
        if Path(self.model).expanduser().exists():
            self.model = str(Path(self.model).expanduser().resolve())

    def load(self):
        return Encoder.from_pretrained(
            self.model, adapter=self.adapter, max_length=self.max_length, precision=self.precision, device=self.device
        )


def encoder_facts(encoder) -> dict:
    """What an index manifest records of an encoder (and what every worker's encoder must share)."""
    return {
        "spec": encoder.spec.to_dict(),
        "max_length": encoder.max_length,
        "precision": getattr(encoder, "embedding_precision", encoder.precision),
        "adapter_merged": encoder.adapter_merged,
        "embedding_dim": encoder.embedding_dim,
    }


class _ShardsMissing(Exception):
    """Raised by :class:`_PlannedEncoder` where a store's build would embed a shard: Ray embeds it instead."""


class _PlannedEncoder:
    """The parts of an Encoder a store's ``build`` reads, as a worker reported them; it embeds nothing."""

    def __init__(self, facts: dict, load: EncoderLoad):
        self.source = load_record(load.model, load.adapter)  # the manifest names the model and adapter, as an Encoder's
        self.spec = EmbeddingSpec.from_dict(facts["spec"])
        self.max_length, self.precision = facts["max_length"], facts["precision"]
        self.adapter_merged, self.embedding_dim = facts["adapter_merged"], facts["embedding_dim"]

    def encode_document(self, texts, **kwargs):
        raise _ShardsMissing


class ShardEmbedder:
    """A Ray actor: loads the encoder once, then embeds one shard per call as ``unimae.retrieval.index`` does."""

    def __init__(self, load: EncoderLoad, facts: dict, batch_size: int, dimensions: int | None):
        self.encoder = load.load()
        if encoder_facts(self.encoder) != facts:
            raise RuntimeError(
                f"this worker's encoder embeds as {encoder_facts(self.encoder)}, not as the first worker's {facts}; "
                "give every worker the same device type, or pass an explicit --precision"
            )
        self.batch_size, self.dimensions = batch_size, dimensions

    def __call__(self, batch: dict) -> dict:
        """batch: {"start": (B,), "ids": (B,) lists, "texts": (B,) lists} -> {"start": (B,), "vectors": (B, n, D),
        "error": (B,) str}: the error names the passage a shard failed on ("" for none; its vectors are zeros)."""
        shards = [
            self.embed([str(i) for i in ids], [str(t) for t in texts])
            for ids, texts in zip(batch["ids"], batch["texts"], strict=True)
        ]
        vectors, errors = zip(*shards, strict=True)
        return {"start": np.asarray(batch["start"]), "vectors": np.stack(vectors), "error": np.asarray(errors)}

    def embed(self, ids: list[str], texts: list[str]) -> tuple[np.ndarray, str]:
        """One shard's texts -> ((n, D) float32 unit rows, ""), or (zeros, what failed on which passage)."""
        try:
            return self._encode(texts), ""
        except Exception as err:  # noqa: BLE001 - reported to the driver, which stops the job
            dim = self.dimensions or self.encoder.embedding_dim
            return np.zeros((len(texts), dim), np.float32), f"{self._culprit(ids, texts)} cannot be embedded: {err!r}"

    def _encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.encoder.encode_document(
            texts, batch_size=self.batch_size, normalize=True, show_progress=False, dimensions=self.dimensions
        )  # (n, D)
        return vectors.astype(np.float32)

    def _culprit(self, ids: list[str], texts: list[str]) -> str:
        """'passage <id>': the first passage that fails alone (else the shard's id range)."""
        for pid, text in zip(ids, texts, strict=True):
            try:
                self._encode([text])
            except Exception:  # noqa: BLE001 - any error of one passage alone names it
                return f"passage {pid!r}"
        return f"the shard of passages {ids[0]!r} to {ids[-1]!r} (each passage alone embeds)"


def build_on_ray(
    load: EncoderLoad,
    passages: Sequence[tuple[str, str]],
    directory: str | Path,
    config: IndexConfig | DiskIndexConfig | None = None,
    source: dict | None = None,
    overwrite: bool = False,
    ray_config: RayConfig | None = None,
) -> VectorIndex | DiskIndex:
    """Build (or resume) the index of ``passages`` in ``directory``, embedding on Ray; the store is
    :class:`~unimae.retrieval.disk_index.DiskIndex` for a :class:`~unimae.retrieval.disk_index.DiskIndexConfig`, else
    :class:`~unimae.retrieval.index.VectorIndex`. ``source`` and ``overwrite`` as in ``VectorIndex.build``."""
    config = config or IndexConfig()
    ray_config = ray_config or RayConfig()
    store = DiskIndex if isinstance(config, DiskIndexConfig) else VectorIndex
    ray = _ray()
    with build_lock(directory):  # held across both builds and the Ray job between them (the driver writes)
        with ray_session(ray, ray_config):
            facts = worker_facts(ray, load, ray_config)
            planned = _PlannedEncoder(facts, load)
            try:
                return store.build(planned, passages, directory, config, source, overwrite)
            except _ShardsMissing:
                pass
            shards = Path(directory) / "shards"
            embed_missing_shards(ray, load, facts, passages, shards, config, ray_config)
        try:
            return store.build(planned, passages, directory, config, source)
        except _ShardsMissing:
            raise VectorIndexError(
                f"shards of {directory} are still missing or damaged after the Ray job (a full disk, or another "
                "process writing the folder?); rerun to embed them"
            ) from None


@contextlib.contextmanager
def ray_session(ray, ray_config: RayConfig) -> Iterator[None]:
    """Join ``ray_config.address`` (else ``$RAY_ADDRESS``), or start a new local Ray sized for the workers; one
    already initialised in this process (by the caller) is used as it is and left running."""
    if ray.is_initialized():
        check_resources(ray, ray_config, local=False)
        yield
        return
    address = ray_config.address or os.environ.get("RAY_ADDRESS")  # `ray job submit` sets RAY_ADDRESS
    if address:
        ray.init(address=address, runtime_env=ray_config.runtime_env)
    else:  # "local": a new Ray even where `ray start` runs one on this machine (joining it takes no num_cpus)
        cpus = math.ceil(ray_config.workers * ray_config.num_cpus_per_worker)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=ray_config.runtime_env)
    try:
        check_resources(ray, ray_config, local=not address)
        yield
    finally:
        ray.shutdown()


def check_resources(ray, ray_config: RayConfig, local: bool) -> None:
    """GPUs per worker that the Ray cluster does not have: an error on a local Ray (it would wait forever for
    them), a warning on a cluster (an autoscaler may add nodes; Ray waits until then)."""
    need, have = ray_config.num_gpus_per_worker, ray.cluster_resources().get("GPU", 0)
    if need <= have:
        return
    message = f"--num-gpus-per-worker {need:g}: the Ray cluster has {have:g} GPUs"
    if local:
        raise VectorIndexError(f"{message} (a local Ray sees this machine's); pass --num-gpus-per-worker 0")
    logger.warning("%s; the job waits until nodes with GPUs join", message)


def worker_facts(ray, load: EncoderLoad, ray_config: RayConfig) -> dict:
    """:func:`encoder_facts` of the encoder as a worker (its resources, its device) loads it."""
    resources = {"num_cpus": ray_config.num_cpus_per_worker, "num_gpus": ray_config.num_gpus_per_worker}
    task = ray.remote(**resources)(_load_facts)
    return ray.get(task.remote(load))


def _load_facts(load: EncoderLoad) -> dict:
    return encoder_facts(load.load())


def embed_missing_shards(
    ray,
    load: EncoderLoad,
    facts: dict,
    passages: Sequence[tuple[str, str]],
    shards: Path,
    config: IndexConfig | DiskIndexConfig,
    ray_config: RayConfig,
) -> int:
    """Embed, on a pool of ``ray_config.workers`` actors, every shard of ``passages`` not already (whole) in
    ``shards``; write each as it arrives -> the number of shards embedded. The missing shards go to Ray Data in
    jobs of ``ray_config.passages_per_job`` passages (whole shards, at least one), so the driver reads and holds
    one job's texts at a time, whatever the corpus's size."""
    dim = config.dimensions or facts["embedding_dim"]
    starts = range(0, len(passages), config.shard_size)
    missing = [start for start in starts if not _shard_ok(shards, start, config.shard_size, len(passages), dim)]
    per_job = max(1, ray_config.passages_per_job // config.shard_size)  # shards
    with tqdm(total=len(missing), desc="index shards (ray)", unit="shard", disable=not missing) as progress:
        for first in range(0, len(missing), per_job):
            rows = [_shard_row(passages, start, config.shard_size) for start in missing[first : first + per_job]]
            _embed_job(ray, rows, load, facts, shards, config, ray_config, progress)
    return len(missing)


def _shard_row(passages: Sequence[tuple[str, str]], start: int, size: int) -> dict:
    """The Ray Data row of the shard starting at ``start``: its first passage, ids and texts."""
    chunk = passages[start : start + size]
    return {"start": start, "ids": [pid for pid, _ in chunk], "texts": [text for _, text in chunk]}


def _embed_job(ray, rows: list[dict], load: EncoderLoad, facts: dict, shards: Path, config, ray_config, progress):
    """One Ray Data job: ``rows`` (shards) through an actor pool of :class:`ShardEmbedder`, each shard written as
    it comes back."""
    embedded = ray.data.from_items(rows).map_batches(
        ShardEmbedder,
        batch_size=1,  # one shard per call: a shard's vectors come back whole
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=min(ray_config.workers, len(rows))),
        fn_constructor_kwargs={
            "load": load,
            "facts": facts,
            "batch_size": config.batch_size,
            "dimensions": config.dimensions,
        },
        num_cpus=ray_config.num_cpus_per_worker,
        num_gpus=ray_config.num_gpus_per_worker,
    )
    try:
        _write_shards(embedded.iter_rows(), shards, progress)
    except ray.exceptions.RayError as err:  # a worker that could not start, a lost node past Ray's retries
        raise VectorIndexError(
            f"the Ray job failed ({_last_line(err)}); the shards embedded before it are kept: rerun to resume"
        ) from err


def _last_line(err: Exception) -> str:
    """The last non-empty line of a Ray error's text (its cause, after Ray's traceback)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _write_shards(rows, shards: Path, progress) -> None:
    """Write each embedded shard atomically as it arrives; the first shard a worker failed on stops the job
    (nothing of it is written) with a :class:`~unimae.retrieval.index.VectorIndexError` naming the passage."""
    rows = iter(rows)
    try:
        for row in rows:
            if str(row["error"]):
                raise VectorIndexError(
                    f"{row['error']}; the shards embedded before it are kept: fix or drop that passage and rerun "
                    "to resume"
                )
            write_shard(shards, int(row["start"]), np.asarray(row["vectors"], dtype=np.float32))  # (n, D)
            progress.update()
    finally:
        if hasattr(rows, "close"):
            rows.close()  # stops the Ray job's remaining work
