"""Supervised contrastive training on tiny random models: the gradient cache, the symmetric loss, false
negatives, one source per batch, data mixtures and their errors, resume."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SENTENCES, read_log, tiny_train_config

from unimae.data.corpus import CorpusError
from unimae.data.order import DataOrder
from unimae.data.pairs import SourceBatchOrder, load_mixture, pair_groups
from unimae.embedding.attention import set_attention_dropout
from unimae.embedding.spec import EmbeddingSpec
from unimae.losses.grad_cache import GradCacheContrastiveObjective
from unimae.losses.info_nce import info_nce
from unimae.losses.supervised_contrastive import ContrastiveObjective
from unimae.models import load_model
from unimae.training.config import TrainConfig, add_config_arguments, resolve_config
from unimae.training.methods import Context, get_method
from unimae.training.methods.contrastive import lm_position
from unimae.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _records(n: int, start: int = 0, negatives: bool = True) -> list[dict]:
    """n pairs of distinct sentences (wrapping around SENTENCES with a numbered suffix)."""
    rows = []
    for i in range(start, start + n):
        text = lambda k: f"{SENTENCES[k % len(SENTENCES)]} {k // len(SENTENCES)}"  # noqa: E731
        row = {"query": text(3 * i), "positive": text(3 * i + 1)}
        if negatives and i % 2 == 0:
            row["negative"] = text(3 * i + 2)
        rows.append(row)
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _method(tokenizer, world_size: int = 1, **overrides):
    values = dict(method="contrastive", max_length=24, batch_size=6, micro_batch_size=6)
    values.update(overrides)
    config = TrainConfig.from_dict(values)
    config.validate(world_size)  # as the trainer does before it builds the method
    return get_method("contrastive")(config, Context(tokenizer, 0, EmbeddingSpec()))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _count_graph_passes(objective) -> list:
    """The rows of each forward through ``objective``'s LLM that builds a graph (a gradient cache's step 3),
    appended as they run."""
    calls, real_hidden = [], objective._hidden

    def hidden(batch, rows=slice(None)):
        if torch.is_grad_enabled():
            calls.append(rows)
        return real_hidden(batch, rows)

    objective._hidden = hidden
    return calls


def _config(tiny_dir, data, out, **overrides):
    return tiny_train_config(tiny_dir, data, out, **{"method": "contrastive", "steps": 4, **overrides})


def _log(out: Path) -> list[dict]:
    return read_log(out)


# --- the gradient cache ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("symmetric", "lm_weight", "lm_texts"), [(False, 0.0, 0), (True, 0.0, 0), (False, 0.5, 0), (False, 0.5, 4)]
)
def test_grad_cache_gives_the_one_big_batch_gradient(tiny_dir, symmetric, lm_weight, lm_texts):
    model, tokenizer, _ = load_model(str(tiny_dir), dtype=torch.float32)
    model.train()
    records = _records(6)
    records[4]["query"] = records[1]["query"]  # a false negative to mask
    method = _method(tokenizer, symmetric_loss=symmetric, lm_weight=lm_weight, lm_texts=lm_texts)
    batch = method.collate(records, list(range(6)))
    assert batch["false_negatives"].shape == (6, 6 + 3)

    big = method.build_objective(model)
    assert type(big) is ContrastiveObjective
    plain = big(batch)
    plain["loss"].backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    options = {"symmetric_loss": symmetric, "lm_weight": lm_weight, "lm_texts": lm_texts, "grad_cache_chunk": 4}
    cached = _method(tokenizer, **options).build_objective(model)
    assert isinstance(cached, GradCacheContrastiveObjective)
    with_graph = _count_graph_passes(cached)
    losses = cached(batch)
    assert with_graph == [] and _grads(model) == {}, "forward alone builds no graph and leaves no gradient"
    losses["loss"].backward()
    assert len(with_graph) == math.ceil(15 / 4)  # 6 queries + 6 positives + 3 negatives, chunks of 4
    assert losses.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.allclose(losses[key], value.detach(), rtol=1e-5, atol=1e-6), key
    got = _grads(model)
    assert got.keys() == expected.keys() and len(got) > 0
    for name, grad in expected.items():
        scale = float(grad.abs().max())  # fp32 sums in another order: compare to the tensor's scale
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_grad_cache_backward_takes_the_callers_scale(tiny_model_dirs):
    """The hook scales each chunk's backward by the gradient the loss receives (the trainer's 1 / accum, a
    loss scale), and leaves the RNG as backward found it; without grad, forward only computes the values."""
    model, tokenizer, _ = load_model(str(tiny_model_dirs["qwen2"]), dtype=torch.float32)
    model.train()
    method = _method(tokenizer, grad_cache_chunk=4, lm_weight=0.5)
    objective, batch = method.build_objective(model), method.collate(_records(6), list(range(6)))
    objective(batch)["loss"].backward()
    whole = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = objective(batch)["loss"]
    rng = torch.get_rng_state()
    (loss * 0.25).backward()
    assert torch.equal(torch.get_rng_state(), rng)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, whole[name] * 0.25, msg=name)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        values = objective(batch)
    assert not values["loss"].requires_grad and torch.allclose(values["loss"], loss.detach())


@pytest.mark.parametrize("lm_texts", [0, 4])
def test_grad_cache_lm_term_runs_the_output_head_in_the_graph_pass_only(tiny_model_dirs, lm_texts):
    """With --lm-weight the no-grad pass embeds only: the output head runs once per chunk holding scored positives,
    in the graph pass (the hook), which then writes the LM value into the returned losses; after backward they
    equal the one-big-batch objective's. Under no_grad, forward computes every value at once."""
    model, tokenizer, _ = load_model(str(tiny_model_dirs["qwen2"]), dtype=torch.float32)
    model.train()
    method = _method(tokenizer, lm_weight=0.5, lm_texts=lm_texts)
    batch = method.collate(_records(6), list(range(6)))
    plain = method.build_objective(model)(batch)
    model.zero_grad(set_to_none=True)

    cached = _method(tokenizer, lm_weight=0.5, lm_texts=lm_texts, grad_cache_chunk=4).build_objective(model)
    head_passes = []  # grad enabled, per output-head pass (NextTokenLoss reads the head's weight, not its forward)
    cached.ntp.register_forward_hook(lambda *_: head_passes.append(torch.is_grad_enabled()))
    with_graph = _count_graph_passes(cached)
    losses = cached(batch)
    assert head_passes == [], "forward runs no output head"
    assert torch.isnan(losses["lm"]) and torch.equal(losses["loss"].detach(), losses["contrastive"]), "not yet"
    losses["loss"].backward()
    b, scored = 6, lm_texts or 6  # rows b .. b + scored - 1: the scored positives
    holding = [rows for rows in with_graph if ((rows >= b) & (rows < b + scored)).any()]
    assert len(with_graph) == 4 and head_passes == [True] * len(holding) and len(holding) > 0
    for key in ("loss", "contrastive", "lm"):
        assert torch.allclose(losses[key], plain[key].detach(), rtol=1e-5, atol=1e-6), key
    model.zero_grad(set_to_none=True)

    head_passes.clear()
    with torch.no_grad():
        values = cached(batch)
    assert head_passes == [False] * len(holding)
    for key in ("loss", "contrastive", "lm"):
        assert torch.allclose(values[key], plain[key].detach(), rtol=1e-5, atol=1e-6), key


def test_grad_cache_replays_dropout(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    set_attention_dropout(model, 0.3)
    model.train()
    method = _method(tokenizer, grad_cache_chunk=3)
    batch = method.collate(_records(6), list(range(6)))
    objective = method.build_objective(model)
    first = objective.embed(batch)
    assert not torch.allclose(first, objective.embed(batch)), "dropout is active"

    seen = []
    real_hidden = objective._hidden

    def hidden(batch, rows=slice(None)):
        out = real_hidden(batch, rows)
        seen.append((torch.is_grad_enabled(), out[0].detach().clone()))
        return out

    objective._hidden = hidden
    objective(batch)["loss"].backward()
    no_grad = [z for grad, z in seen if not grad]
    with_grad = [z for grad, z in seen if grad]
    assert len(no_grad) == len(with_grad) == 5
    for a, b in zip(no_grad, with_grad, strict=True):
        assert torch.equal(a, b), "the re-run with a graph must see the same dropout masks"


def test_lm_term_is_the_next_token_loss_of_the_positives(tiny_model_dirs):
    """--lm-weight: the mean over the positives of each one's next-token CE (its own forward, as generation
    sees it), added to InfoNCE with that weight; logged as "lm"."""
    import torch.nn.functional as F

    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    method = _method(tokenizer, lm_weight=0.5)
    batch = method.collate(_records(6), list(range(6)))
    out = method.build_objective(model)(batch)
    expected = []
    with torch.no_grad():
        for row in range(6, 12):  # rows: 6 queries, then their 6 positives
            ids = batch["input_ids"][row, : int(batch["attention_mask"][row].sum())]
            expected.append(F.cross_entropy(model(ids[None]).logits[0, :-1].float(), ids[1:]))
    assert float(out["lm"]) == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)
    assert float(out["loss"]) == pytest.approx(float(out["contrastive"] + 0.5 * out["lm"]), rel=1e-5)
    assert "lm" not in _method(tokenizer).build_objective(model)(batch), "off by default"
    first_two = _method(tokenizer, lm_weight=0.5, lm_texts=2).build_objective(model)(batch)
    assert float(first_two["lm"]) == pytest.approx(float(torch.stack(expected[:2]).mean()), rel=1e-5)


def _lm_texts(path: Path, n: int = 7) -> Path:
    path.write_text("".join(f"the note number {i} ends here.\n" for i in range(n)))
    return path


def test_lm_data_gives_the_next_token_term_its_own_texts(tiny_model_dirs, tmp_path):
    """--lm-data: the term is the mean next-token CE of --lm-texts texts of that source (the positives unscored),
    read in a seeded order that visits every text once per pass; the gradient cache gives the same loss and
    gradient, running those texts after its chunks."""
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    model.train()
    source = _lm_texts(tmp_path / "lm.txt")
    method = _method(tokenizer, lm_weight=0.5, lm_texts=4, lm_data=str(source))
    batch = method.collate(_records(6), list(range(6, 12)))
    texts = source.read_text().splitlines()
    read = [texts[lm_position(i, 7, 0)] for i in range(6, 10)]
    assert batch["lm_input_ids"].shape[0] == 4
    assert [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(batch["lm_input_ids"], batch["lm_attention_mask"], strict=True)
    ] == read
    plain = method.build_objective(model)(batch)
    expected = []
    with torch.no_grad():
        for ids, mask in zip(batch["lm_input_ids"], batch["lm_attention_mask"], strict=True):
            ids = ids[: int(mask.sum())]
            expected.append(F.cross_entropy(model(ids[None]).logits[0, :-1].float(), ids[1:]))
    assert float(plain["lm"]) == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)
    plain["loss"].backward()
    whole = _grads(model)
    model.zero_grad(set_to_none=True)

    cached = _method(tokenizer, lm_weight=0.5, lm_texts=4, lm_data=str(source), grad_cache_chunk=3)
    losses = cached.build_objective(model)(batch)
    losses["loss"].backward()
    for key in ("loss", "contrastive", "lm"):
        assert float(losses[key]) == pytest.approx(float(plain[key]), rel=1e-5), key
    for name, grad in whole.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(_grads(model)[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_lm_position_visits_every_text_once_a_pass():
    first, second = ([lm_position(i, 7, 3) for i in range(e * 7, e * 7 + 7)] for e in (0, 1))
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    assert [lm_position(i, 7, 3) for i in range(7)] == first, "a pure function of (index, size, seed)"


@pytest.mark.parametrize("lm_weight", [0.0, 0.5])
def test_training_with_grad_cache_follows_the_plain_loss_curve(tiny_model_dirs, tmp_path, lm_weight):
    """The logged values too: with --lm-weight the cache's LM value is written in backward, before the log."""
    tiny = tiny_model_dirs["qwen2"]
    data = _write(tmp_path / "pairs.jsonl", _records(8))
    train(_config(tiny, data, tmp_path / "plain", steps=3, lm_weight=lm_weight))
    train(_config(tiny, data, tmp_path / "cached", steps=3, lm_weight=lm_weight, grad_cache_chunk=3))
    for a, b in zip(_log(tmp_path / "plain"), _log(tmp_path / "cached"), strict=True):
        assert a.keys() == b.keys() and ("lm" in a) == bool(lm_weight)
        for key in ("loss", "contrastive", "lm")[: 3 if lm_weight else 2]:
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


def test_grad_cache_needs_the_whole_batch_on_one_process(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    with pytest.raises(ValueError, match="--micro-batch-size equal to --batch-size"):
        _method(tokenizer, batch_size=8, micro_batch_size=4, grad_cache_chunk=2)
    with pytest.raises(ValueError, match=">= 0"):
        _method(tokenizer, grad_cache_chunk=-1)
    _method(tokenizer, batch_size=8, micro_batch_size=4)  # accumulation without the cache is fine
    with pytest.raises(ValueError, match="one process"):
        _method(tokenizer, world_size=2, grad_cache_chunk=2)


# --- the loss ----------------------------------------------------------------------------------------


def test_symmetric_info_nce_adds_the_positive_to_queries_direction():
    torch.manual_seed(0)
    a, c = torch.randn(4, 8), torch.randn(6, 8)  # 4 anchors; 4 positives + 2 hard negatives
    logits = F.normalize(a, dim=-1) @ F.normalize(c, dim=-1).T / 0.1
    labels = torch.arange(4)
    forward = F.cross_entropy(logits, labels)
    backward = F.cross_entropy(logits[:, :4].T, labels)  # positive i against the 4 anchors
    assert torch.allclose(info_nce(a, c, 0.1), forward)
    assert torch.allclose(info_nce(a, c, 0.1, symmetric=True), (forward + backward) / 2)
    assert not torch.allclose(forward, backward)


def test_excluded_candidates_do_not_count_but_positives_always_do():
    torch.manual_seed(0)
    a, c = torch.randn(3, 8), torch.randn(4, 8)
    exclude = torch.zeros(3, 4, dtype=torch.bool)
    exclude[0, 1] = exclude[1, 0] = True  # rows 0 and 1 are duplicates
    exclude[2, 2] = True  # a positive is never excluded
    moved = c.clone()
    moved[1] = a[0]  # candidate 1 now looks exactly like anchor 0: it must not matter to row 0
    for symmetric in (False, True):
        base = info_nce(a, c, 0.1, exclude=exclude, symmetric=symmetric)
        assert torch.isfinite(base)
        row0 = lambda cand: info_nce(a[:1], cand, 0.1, exclude=exclude[:1])  # noqa: E731
        assert torch.allclose(row0(c), row0(moved))
    assert torch.allclose(info_nce(a, c, 0.1, exclude=torch.eye(3, 4, dtype=torch.bool)), info_nce(a, c, 0.1))


def test_pair_groups_link_duplicates_and_reversed_pairs():
    records = [
        {"query": "q1", "positive": "p1", "negative": "p3"},  # its negative is row 3's positive: a true negative
        {"query": "q1", "positive": "p2"},  # same query as row 0
        {"query": "p1", "positive": "x"},  # starts from row 0's positive
        {"query": "q3", "positive": "p3", "negative": "q1"},  # its negative belongs to rows 0-2's group
        {"query": "y", "positive": "q3"},  # reversed: its positive is row 3's query
        {"query": "z", "positive": "w", "negative": "w"},  # its negative equals its own positive
    ]
    rows, negatives = pair_groups(records)
    assert rows[0] == rows[1] == rows[2] and rows[3] == rows[4]
    assert len({rows[0], rows[3], rows[5]}) == 3
    assert negatives == [rows[3], rows[0], rows[5]]


def test_collate_masks_false_negatives_only_when_asked(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    records = _records(4)
    records[3]["positive"] = records[0]["positive"]
    batch = _method(tokenizer).collate(records, [0, 1, 2, 3])
    mask = batch["false_negatives"]  # (4, 4 + 2)
    assert batch["num_queries"] == 4 and batch["input_ids"].shape[0] == 10
    assert mask[0, 3] and mask[3, 0] and mask.diagonal().all()
    assert mask.sum() == 4 + 2
    assert "false_negatives" not in _method(tokenizer, mask_false_negatives=False).collate(records, [0, 1, 2, 3])


# --- data: mixtures, one source per batch ---------------------------------------------------------


def test_each_batch_comes_from_one_source_with_the_given_weights():
    sizes, weights, batch = [40, 13, 100], [1.0, 1.0, 2.0], 4
    order = SourceBatchOrder(sizes, weights, batch, seed=3)
    offsets = [0, 40, 53, 153]
    steps = 2000
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in range(steps):
        indices = [order.text_index(step * batch + k) for k in range(batch)]
        source = order.source_of(step)
        assert all(offsets[source] <= i < offsets[source + 1] for i in indices), step
        assert len(set(indices)) == batch
        seen[source].extend(indices)
    counts = [len(seen[s]) / batch for s in range(3)]
    for count, weight in zip(counts, weights, strict=True):
        assert count / steps == pytest.approx(weight / sum(weights), abs=0.04)
    first_epoch = seen[1][: (13 // batch) * batch]  # an epoch of a source has no repeats (the remainder is skipped)
    assert len(set(first_epoch)) == len(first_epoch)
    late = SourceBatchOrder(sizes, weights, batch, seed=3)  # a pure function of (seed, index): any query order
    assert [late.text_index(i) for i in (7999, 4000, 3)] == [order.text_index(i) for i in (7999, 4000, 3)]
    other = SourceBatchOrder(sizes, weights, batch, seed=4)
    assert [other.source_of(s) for s in range(50)] != [order.source_of(s) for s in range(50)]
    with pytest.raises(ValueError, match="fill a batch"):
        SourceBatchOrder([3, 10], [1.0, 1.0], 4, seed=0)
    assert SourceBatchOrder([3, 10], [0.0, 1.0], 4, seed=0).text_index(5) >= 3  # weight 0: never drawn


def test_the_options_are_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = "--method contrastive --data a.jsonl,b.jsonl --data-weights sqrt --symmetric-loss --grad-cache-chunk 16"
    config = resolve_config(parser.parse_args([*flags.split(), "--no-mask-false-negatives", "--temperature", "0.02"]))
    options = config.options
    assert (options.data_weights, options.symmetric_loss, options.grad_cache_chunk) == ("sqrt", True, 16)
    assert not options.mask_false_negatives and options.temperature == 0.02


def test_mixture_from_files_weights_and_mixture_files(tmp_path):
    a = _write(tmp_path / "a.jsonl", _records(10))
    b = _write(tmp_path / "b.jsonl", _records(40, start=10, negatives=False))
    both = f"{a},{b}"
    assert load_mixture(both, "", 4).weights == [10.0, 40.0]
    assert load_mixture(both, "sqrt", 4).weights == pytest.approx([math.sqrt(10), math.sqrt(40)])
    mixture = load_mixture(both, "3, 1", 4)
    assert mixture.weights == [3.0, 1.0] and mixture.sizes == [10, 40] and len(mixture.pairs) == 50
    assert mixture.pairs[10] == {**_records(1, start=10, negatives=False)[0], "source": "b"}
    (tmp_path / "sub").mkdir()
    mix = "sources:\n  - path: ../a.jsonl\n    weight: 2\n  - {path: ../b.jsonl, weight: 0.5}\n"
    (tmp_path / "sub" / "mix.yaml").write_text(mix)
    assert load_mixture(str(tmp_path / "sub" / "mix.yaml"), "", 4).weights == [2.0, 0.5]
    assert load_mixture(str(tmp_path / "sub" / "mix.yaml"), "size", 4).weights == [10.0, 40.0]
    (tmp_path / "mix.json").write_text(json.dumps([str(a), {"path": "b.jsonl"}]))
    assert load_mixture(str(tmp_path / "mix.json"), "", 4).weights == [10.0, 40.0]
    assert load_mixture(f"{a},{b}", "0,1", 20).sizes == [10, 40]  # a weight-0 source may be small


@pytest.mark.parametrize(
    ("data", "weights", "batch", "message"),
    [
        ("{a},{b}", "1,2,3", 4, "3 numbers for 2"),
        ("{a},{b}", "1,-1", 4, ">= 0"),
        ("{a},{b}", "one,two", 4, "one number per --data file"),
        ("{a},{b}", "", 20, r"a\.jsonl has 10 pairs, fewer than --batch-size 20"),
        ("{a},{a}", "", 4, "twice"),
        ("{a},{tmp}/missing.jsonl", "", 4, "missing.jsonl' is not such a file"),
        ("{tmp}/bad.yaml", "", 4, "entry 2: expected a list"),
        ("{tmp}/partial.yaml", "", 4, "every entry or for none"),
        ("{tmp}/nope.yaml", "", 4, "does not exist"),
        ("{tmp}/broken.json", "", 4, "cannot be parsed"),
        ("{tmp}/broken.yaml", "", 4, "cannot be parsed"),
    ],
)
def test_bad_mixtures_are_clear_errors(tmp_path, data, weights, batch, message):
    a = _write(tmp_path / "a.jsonl", _records(10))
    b = _write(tmp_path / "b.jsonl", _records(40, start=10))
    (tmp_path / "bad.yaml").write_text(f"- {a}\n- [1, 2]\n")
    (tmp_path / "partial.yaml").write_text(f"- {{path: {a}, weight: 1}}\n- {{path: {b}}}\n")
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "broken.yaml").write_text("- [a\n- b: c: d\n")
    with pytest.raises(CorpusError, match=message):
        load_mixture(data.format(a=a, b=b, tmp=tmp_path), weights, batch)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"query": "a", "positive": "b"}\n{"query": "c", "positive": "d"}\n{"query": "e"}\n', "line 3.*positive"),
        (b'{"query": "a", "positive": "b"}\n{"query": "c", "positive": \n', "line 2: not valid JSON"),
        (b'{"query": "a", "positive": "b", "negative": 3}\n', "line 1: 'negative' must be a string"),
        (b'{"query": "a", "positive": "  "}\n', r"line 1: missing or empty field\(s\) \['positive'\]"),
        (b'{"query": "a", "positive": "b"}\n{"query": "\xff", "positive": "b"}\n', "line 2: invalid UTF-8"),
        (b'{"query": "a", "positive": "b"}\n', "at least 2 pairs"),
        # before: accepted, and the tokenizer failed hours later at the step that drew the pair
        (
            b'{"query": "a", "positive": "b"}\n{"query": "c", "positive": "\\ud800"}\n',
            "line 2: 'positive' holds a lone",
        ),
        (b'{"query": "a", "positive": "b", "negative": "x\\udfff"}\n', "line 1: 'negative' holds a lone surrogate"),
    ],
)
def test_bad_pair_files_name_the_file_and_line(tmp_path, content, message):
    good = _write(tmp_path / "good.jsonl", _records(10))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    with pytest.raises(CorpusError, match=message) as err:
        load_mixture(f"{good},{bad}", "", 2)
    assert str(bad) in str(err.value)


def test_other_methods_keep_the_trainers_data_order(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    method = get_method("unimae")(TrainConfig(), Context(tokenizer, 0, EmbeddingSpec()))
    order = method.example_order(37, 5)
    assert isinstance(order, DataOrder)
    reference = DataOrder(37, 5)
    assert [order.text_index(i) for i in range(100)] == [reference.text_index(i) for i in range(100)]


# --- training runs ------------------------------------------------------------------------------------


def test_mixture_training_resumes_the_same_loss_curve(tiny_model_dirs, tmp_path):
    tiny = tiny_model_dirs["gemma3"]
    a = _write(tmp_path / "a.jsonl", _records(8))
    b = _write(tmp_path / "b.jsonl", _records(12, start=8, negatives=False))
    data = f"{a},{b}"
    common = dict(data_weights="1,1", grad_cache_chunk=3, symmetric_loss=True, save_every=2)
    train(_config(tiny, data, tmp_path / "straight", steps=4, **common))
    train(_config(tiny, data, tmp_path / "resumed", steps=2, **common))
    train(_config(tiny, data, tmp_path / "resumed", steps=4, **common), resume=True)
    straight, resumed = _log(tmp_path / "straight"), _log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for x, y in zip(straight, resumed, strict=True):
        assert x["contrastive"] == pytest.approx(y["contrastive"], rel=1e-5)
        assert x["tokens"] == y["tokens"]
    options = json.loads((tmp_path / "resumed" / "config.json").read_text())["options"]  # the method's, nested
    assert options["grad_cache_chunk"] == 3 and options["data_weights"] == "1,1"


def test_make_pairs_wiki_writes_pairs_the_trainer_reads(tmp_path):
    sentences = [s.capitalize() + "." for s in SENTENCES]
    paragraphs = [
        {
            "title": f"Article {i}",
            "text": f"First sentence number {i} is here. " + " ".join(sentences[2 * i : 2 * i + 2]),
        }
        for i in range(6)
    ]
    paragraphs[0]["text"] = "Too short. Only two."
    source = _write(tmp_path / "wiki.jsonl", paragraphs)
    for mode in ("ict", "title"):
        out = tmp_path / f"{mode}.jsonl"
        args = ["--pretrain", str(source), "--output", str(out), "--mode", mode, "--no-exclude-gensim"]
        subprocess.run([sys.executable, str(ROOT / "recipes" / "make_pairs_wiki.py"), *args], check=True)
        pairs = load_mixture(str(out), "", 2).pairs
        assert len(pairs) == (5 if mode == "ict" else 6)
        if mode == "title":
            assert pairs[1] == {"query": "Article 1", "positive": paragraphs[1]["text"], "source": out.stem}


# --- the learning-rate schedule -------------------------------------------------------------------------


def test_lr_schedules_decay_from_their_step_to_zero_at_the_end(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    assert [_method(tokenizer, steps=10).lr_lambda(s) for s in range(10)] == [1.0] * 10, "constant by default"
    linear = [_method(tokenizer, steps=10, lr_schedule="linear", lr_decay_from=4).lr_lambda(s) for s in range(10)]
    assert linear[:5] == [1.0] * 5
    assert linear[5:] == pytest.approx([1 - k / 6 for k in range(1, 6)])
    cosine = _method(tokenizer, steps=10, lr_schedule="cosine")
    assert cosine.lr_lambda(0) == 1.0 and cosine.lr_lambda(5) == pytest.approx(0.5) and cosine.lr_lambda(10) < 1e-12
    assert all(cosine.lr_lambda(s) > cosine.lr_lambda(s + 1) for s in range(9))
    assert cosine.fixed_on_resume(0) == set() and cosine.fixed_on_resume(3) == {"steps"}, "a decay under way"
    assert _method(tokenizer, steps=10).fixed_on_resume(3) == set()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(lr_schedule="linear", lr_decay_from=10), "must start before the last step"),
        (dict(lr_decay_from=-1), "--lr-decay-from must be >= 0"),
        (dict(lr_schedule="step"), "lr_schedule"),
    ],
)
def test_bad_lr_schedules_are_clear_errors(tiny_model_dirs, overrides, message):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    with pytest.raises(ValueError, match=message):
        _method(tokenizer, steps=10, **overrides)


def test_a_continued_run_may_decay_its_learning_rate_over_the_new_steps(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(24))
    tiny = tiny_model_dirs["llama"]
    train(_config(tiny, data, tmp_path / "a", steps=2))
    source = str(tmp_path / "a" / "adapter")
    decay = dict(lr_schedule="linear", lr_decay_from=2, save_every=1)
    train(_config(tiny, data, tmp_path / "b", steps=4, continue_adapter=source, **decay))
    assert [r["lr"] for r in _log(tmp_path / "b")] == pytest.approx([5e-3, 2.5e-3]), "1 then 1/2 of --lr"
    with pytest.raises(ValueError, match="steps 4 -> 6"):  # resuming it with another length would bend the decay
        train(_config(tiny, data, tmp_path / "b", steps=6, continue_adapter=source, **decay), resume=True)


def test_a_continued_run_may_reweight_or_resource_its_next_token_term_but_not_resize_it(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(24))
    tiny = tiny_model_dirs["llama"]
    train(_config(tiny, data, tmp_path / "a", steps=2, lm_weight=0.1, lm_texts=4))
    source = str(tmp_path / "a" / "adapter")
    train(_config(tiny, data, tmp_path / "b", steps=3, continue_adapter=source, lm_weight=0.3, lm_texts=4))
    assert json.loads((tmp_path / "b" / "adapter" / "unimae.json").read_text())["training_config"]["options"][
        "lm_weight"
    ] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="lm_texts 4 -> 8"):  # how many texts the term reads stays the run's
        train(_config(tiny, data, tmp_path / "c", steps=3, continue_adapter=source, lm_weight=0.3, lm_texts=8))
    lm_data = str(_lm_texts(tmp_path / "lm.txt"))  # ...but not their source
    train(
        _config(
            tiny, data, tmp_path / "d", steps=3, continue_adapter=source, lm_weight=0.3, lm_texts=4, lm_data=lm_data
        )
    )
    options = json.loads((tmp_path / "d" / "adapter" / "unimae.json").read_text())["training_config"]["options"]
    assert options["lm_data"] == lm_data and "lm" in _log(tmp_path / "d")[-1]


def test_options_nothing_reads_are_warned(caplog):
    from unimae.training.config import TrainConfig

    config = TrainConfig.from_dict(
        {
            "method": "contrastive",
            "lm_texts": 4,
            "lm_data": "enwiki-gensim",
            "query_prompt_dropout": 0.5,
            "lr_decay_from": 3,
            "steps": 10,
        }  # fmt: skip
    )
    with caplog.at_level("WARNING"):
        config.validate()
    for option in ("--lm-texts (without", "--lm-data (without", "--query-prompt-dropout", "--lr-decay-from (with"):
        assert option in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        TrainConfig.from_dict({"method": "contrastive", "lm_texts": 4, "lm_weight": 0.1}).validate()
    assert "does nothing" not in caplog.text
