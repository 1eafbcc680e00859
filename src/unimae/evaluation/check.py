"""Before/after check of a trained adapter: is the [EOS] embedding better, is generation intact?

- STSBenchmark test Spearman (cosine), when the STSBenchmark file is available (``--sts``, or
  ``$UNIMAE_DATA`` / ``../shared/data`` in the layout of the project's data README). A plain
  scipy computation; the full MTEB suite lives in ``unimae evaluate``.
- Paragraph-halves retrieval on held-out Wikipedia articles of the default corpus (always
  available offline): embed the first and second half of each paragraph; accuracy@1 of finding
  a paragraph's second half from its first half.
- One greedy generation with the adapter off and on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from unimae.data.corpus import enwiki_gensim_paragraphs
from unimae.encoder import Encoder
from unimae.evaluation.local_data import read_jsonl
from unimae.files import find_data_dir

STSB_RELATIVE = Path("sts/STSBenchmark/test.jsonl")


def load_sts_pairs(path: str | Path) -> tuple[list[str], list[str], np.ndarray]:
    """(sentences 1, sentences 2, gold scores) of an STS ``test.jsonl``; a bad line names file and line."""
    rows = list(read_jsonl(Path(path), ("sentence1", "sentence2", "score"), "STS"))
    return [r["sentence1"] for r in rows], [r["sentence2"] for r in rows], np.asarray([float(r["score"]) for r in rows])


def sts_spearman(encoder: Encoder, s1: list[str], s2: list[str], gold: np.ndarray, batch_size: int = 32) -> float:
    """Spearman correlation (x100) of cosine similarity with the gold scores."""
    a = encoder.encode(s1, batch_size=batch_size, normalize=True)
    b = encoder.encode(s2, batch_size=batch_size, normalize=True)
    return float(spearmanr((a * b).sum(-1), gold).statistic * 100)


def halves_retrieval(encoder: Encoder, paragraphs: list[str], batch_size: int = 32) -> float:
    """Accuracy@1 (x100) of retrieving each paragraph's second half from its first half."""
    firsts, seconds = [], []
    for para in paragraphs:
        words = para.split()
        mid = len(words) // 2
        firsts.append(" ".join(words[:mid]))
        seconds.append(" ".join(words[mid:]))
    q = encoder.encode(firsts, batch_size=batch_size, normalize=True)
    d = encoder.encode(seconds, batch_size=batch_size, normalize=True)
    return float(((q @ d.T).argmax(1) == np.arange(len(q))).mean() * 100)


@dataclass
class CheckResult:
    rows: list[tuple[str, str, float]]  # (setting, metric, score)
    generation: dict[str, str]

    def table(self) -> str:
        lines = ["| setting | metric | score |", "|---|---|---|"]
        lines += [f"| {s} | {m} | {v:.2f} |" for s, m, v in self.rows]
        return "\n".join(lines)


def run_check(
    model: str,
    adapter: str | None,
    sts: str | None = None,
    max_paragraphs: int = 300,
    prompt: str = "The capital of France is",
    max_length: int = 128,
    device: str = "auto",
    precision: str = "auto",
) -> CheckResult:
    """Base mean, base eos and (with ``adapter``) trained eos on STSB and held-out halves, on ``device`` in
    ``precision`` (see :class:`~unimae.encoder.Encoder`)."""
    if sts is None:
        data = find_data_dir()
        sts = str(data / STSB_RELATIVE) if data and (data / STSB_RELATIVE).is_file() else None
    pairs = load_sts_pairs(sts) if sts else None
    paragraphs = enwiki_gensim_paragraphs("heldout")[:max_paragraphs]
    encoder = Encoder.from_pretrained(
        model, adapter=adapter, pooling="eos", merge=False, max_length=max_length, device=device, precision=precision
    )
    settings = [("base mean", "mean", False), ("base eos", "eos", False)]
    if adapter:
        settings.append(("unimae eos", "eos", True))
    rows = []
    for name, pooling, use_adapter in settings:
        view = encoder.with_pooling(pooling)
        with contextlib.nullcontext() if use_adapter else encoder.adapter_disabled():
            if pairs is not None:
                rows.append((name, "STSBenchmark test Spearman", sts_spearman(view, *pairs)))
            rows.append((name, f"held-out halves acc@1 (n={len(paragraphs)})", halves_retrieval(view, paragraphs)))
    with encoder.adapter_disabled():
        generation = {"base": encoder.generate(prompt, max_new_tokens=20)}
    if adapter:
        generation["unimae"] = encoder.generate(prompt, max_new_tokens=20)
    return CheckResult(rows, generation)
