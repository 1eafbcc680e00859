"""Fixtures: tiny random Llama / Gemma3 / Qwen2 models and tokenizers (unimae.tiny_models, no download)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unimae.tiny_models import ARCHITECTURES, SENTENCES, build_model, build_tokenizer, save_tiny_model

__all__ = ["ARCHITECTURES", "SENTENCES", "build_model", "build_tokenizer"]  # imported by the tests from here

SHARED_DATA = Path(os.environ.get("UNIMAE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
# The user's model cache, where the integration tests find (or build once) the dequantized offline models.
REAL_CACHE = os.environ.get("UNIMAE_CACHE_REAL", str(Path.home() / ".cache" / "unimae"))
# .ci/run sets it: `make test` installs every extra, so a test that would skip for a missing one (a broken wheel)
# fails instead of leaving CI green with dozens of skips.
REQUIRE_EXTRAS = os.environ.get("UNIMAE_REQUIRE_EXTRAS") == "1"

if REQUIRE_EXTRAS:
    import importlib

    def _import_or_fail(modname: str, minversion=None, reason=None, **kwargs):
        return importlib.import_module(modname)  # an ImportError fails the test

    pytest.importorskip = _import_or_fail


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where PyTorch sees no CUDA device (CPU machines, CPU-only builds)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


class RecordingTokenizer:
    """A tokenizer that remembers the longest text it was called with (everything else is the tokenizer's)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.longest = max([self.longest, *map(len, [text] if isinstance(text, str) else text)])
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{arch: directory with a tiny random model and tokenizer}, saved once per session."""
    return {arch: save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}")) for arch in ARCHITECTURES}


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_dir(tiny_model_dirs, arch) -> Path:
    return tiny_model_dirs[arch]


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIMAE_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_encoder():
    """The real SmolLM2-135M (eos pooling), loaded once per session from the user's model cache.

    ``UNIMAE_CACHE`` points at that cache only while the model loads; every test still runs with its
    own empty cache (``_isolated_cache``), and the variable is restored even if loading fails.
    """
    from unimae.encoder import Encoder

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", REAL_CACHE)
        return Encoder.from_pretrained("smollm2-135m", pooling="eos", max_length=128)


def tiny_train_config(tiny_dir, data, out, **overrides):
    """A TrainConfig for a few fast fp32 steps on a tiny model (one batch of 4 texts per step).

    p_mar is the paper's 0.5 (not the CPU recipe's 0) so that the tests exercise MAR masking too."""
    from unimae.training.config import TrainConfig

    values = dict(
        model=str(tiny_dir), data=str(data), output_dir=str(out), steps=12, batch_size=4, micro_batch_size=4,
        max_length=24, save_every=0, precision="fp32", lora_r=8, lora_alpha=16, lr=5e-3, seed=0, p_mar=0.5,
    )  # fmt: skip
    values.update(overrides)
    return TrainConfig.from_dict(values)  # flag-named: the options of another method (p_mar) are dropped


def short_train_config(tiny_dir, data, out, **overrides):
    """tiny_train_config's run made short: 4 steps of 2 micro-batches of 2 texts at TrainConfig's lr (1e-4), a
    rank-4 LoRA and a checkpoint every 2 steps (the trainer and resume tests' run)."""
    values = dict(steps=4, micro_batch_size=2, save_every=2, lora_r=4, lora_alpha=8, lr=1e-4)
    return tiny_train_config(tiny_dir, data, out, **{**values, **overrides})


@pytest.fixture(scope="session")
def tiny_trained_run(tiny_model_dirs, tmp_path_factory):
    """(TrainResult, model dir) of a finished 2-step run of the tiny Llama with checkpoints at steps 1 and 2,
    trained once per session. Tests copy its adapter or checkpoints before they damage them."""
    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    root = tmp_path_factory.mktemp("trained-run")
    corpus = root / "corpus.txt"
    corpus.write_text("the cat sat on the mat\na dog ran across the field\nrain fell on the city\nthe river flows\n")
    config = TrainConfig(
        model=str(tiny_model_dirs["llama"]), data=str(corpus), output_dir=str(root / "run"), steps=2, batch_size=2,
        micro_batch_size=2, max_length=16, save_every=1, precision="fp32", lora_r=4, lora_alpha=8,
    )  # fmt: skip
    return train(config), tiny_model_dirs["llama"]


def read_log(out) -> list[dict]:
    """The per-step records of a run's log.jsonl."""
    import json

    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def post_embeddings(encoder, bodies: list[dict]) -> list:
    """POST each body to /v1/embeddings of an in-process server over ``encoder``; the responses."""
    import asyncio

    import httpx

    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    app = create_app(encoder, ServerConfig(model_name="tiny"))
    state = app.state.server

    async def run():
        state.batcher.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            responses = [await http.post("/v1/embeddings", json=body) for body in bodies]
        await state.batcher.stop()
        return responses

    return asyncio.run(run())


@contextlib.contextmanager
def serving_in_a_thread(app, wait: float = 60) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread on a free 127.0.0.1 port -> its base URL; stopped on exit. ``wait``
    seconds: a guard against a hang, never an ordering device."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + wait
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(wait)


@pytest.fixture
def fake_server(monkeypatch):
    """Serve without loading a model or binding a port; returns the ServerConfigs create_app received."""
    configs = []
    monkeypatch.setattr("unimae.encoder.Encoder.from_pretrained", lambda *args, **kwargs: "encoder")
    monkeypatch.setattr("unimae.serving.app.create_app", lambda encoder, config, index: configs.append(config))
    monkeypatch.setattr("unimae.cli.serve.run_uvicorn", lambda app, sock, config: sock.close())
    monkeypatch.setattr("unimae.cli.serve.check_port", lambda host, port: None)  # 8000 may be taken here
    monkeypatch.setattr("unimae.cli.serve.listen", lambda host, port: _Bound())
    monkeypatch.delenv("UNIMAE_API_KEY", raising=False)
    return configs


class _Bound:
    """A stand-in for the bound socket of ``serve.listen``."""

    def getsockname(self):
        return ("127.0.0.1", 8000)

    def close(self):
        pass
