"""Hard-negative mining (unimae.data.mining, `unimae mine`): eq. (1)'s margin, the rank window, the pairs'
order, the batches a budgeted run draws, resume and its refusal of other settings."""

from __future__ import annotations

import json

import pytest
import torch

from unimae.data.mining import MiningConfig, mine_source, pick_negatives, rows_drawn
from unimae.data.pairs import load_mixture, load_pairs


def _unit(rows: list[list[float]]) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def _cosines(values: list[float]) -> torch.Tensor:
    """Pool vectors (P, 2) whose cosine with the query [1, 0] is each of ``values``."""
    return torch.tensor([[v, (1 - v * v) ** 0.5] for v in values])


QUERY = torch.tensor([[1.0, 0.0]])


def test_margin_drops_candidates_near_the_positive_and_the_hardest_survivor_is_taken():
    pool = _cosines([0.80, 0.79, 0.70, 0.50, 0.20])  # index 0: the positive (s+ = 0.8)
    picks = pick_negatives(QUERY, pool, torch.tensor([0]), [[0]], MiningConfig(relative_margin=0.05))
    assert picks.index == [2]  # 0.79 > 0.8 - 0.04 dropped; 0.70 is the hardest left
    assert picks.dropped_by_margin == 1
    assert pick_negatives(QUERY, pool, torch.tensor([0]), [[0]], MiningConfig(relative_margin=0.0)).index == [1]


def test_range_min_skips_and_none_left_is_minus_one():
    pool = _cosines([0.9, 0.6, 0.5, 0.4])
    skip = MiningConfig(relative_margin=0.0, range_min=1, range_max=3)
    assert pick_negatives(QUERY, pool, torch.tensor([0]), [[0]], skip).index == [2]
    excluded_all = pick_negatives(QUERY, pool, torch.tensor([0]), [[0, 1, 2, 3]], MiningConfig())
    assert excluded_all.index == [-1]


def test_random_sampling_stays_in_the_window():
    pool = _cosines([0.9, 0.6, 0.5, 0.4, 0.3, 0.1])
    config = MiningConfig(relative_margin=0.0, range_max=3, sampling="random", seed=3)
    queries = QUERY.repeat(40, 1)
    picks = pick_negatives(queries, pool, torch.zeros(40, dtype=torch.long), [[0]] * 40, config)
    assert set(picks.index) <= {1, 2, 3} and len(set(picks.index)) > 1


@pytest.mark.parametrize(
    "bad", [dict(relative_margin=1.0), dict(range_min=5, range_max=5), dict(sampling="best"), dict(pool_size=-1)]
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        MiningConfig(**bad)


VECTORS = {"q1": [1, 0, 0], "p1": [0.9, 0.1, 0], "q2": [0, 1, 0], "p2": [0, 1, 0.1], "q3": [0, 0, 1], "p3": [0.5, 0, 1]}


def _embed(texts):
    return _unit([VECTORS[t] for t in texts])


def test_mine_source_keeps_order_and_given_negatives_and_never_returns_the_pair_itself():
    pairs = [
        {"query": "q1", "positive": "p1"},
        {"query": "q2", "positive": "p2", "negative": "given"},
        {"query": "q3", "positive": "p3"},
    ]
    mined, stats = mine_source(pairs, [0, 1, 2], _embed, _embed, MiningConfig(relative_margin=0.0))
    assert [p["query"] for p in mined] == ["q1", "q2", "q3"]
    assert mined[1]["negative"] == "given"
    assert mined[0]["negative"] == "p3" and mined[2]["negative"] == "p2"  # the closest other positive
    assert stats["kept_given"] == 1 and stats["mined"] == 2 and stats["none_found"] == 0
    replaced, _ = mine_source(pairs, [1], _embed, _embed, MiningConfig(relative_margin=0.0, keep_given=False))
    assert replaced[1]["negative"] != "given" and "negative" not in replaced[0]


def _write_pairs(path, n, negative_every=0):
    rows = []
    for i in range(n):
        row = {"query": f"question {i} about topic {i % 5}", "positive": f"passage {i} on topic {i % 5}"}
        if negative_every and i % negative_every == 0:
            row["negative"] = f"unrelated text {i}"
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_rows_drawn_are_the_batches_training_draws(tmp_path):
    data = f"{_write_pairs(tmp_path / 'a.jsonl', 20)},{_write_pairs(tmp_path / 'b.jsonl', 9)}"
    mixture = load_mixture(data, "sqrt", 4)
    rows = rows_drawn(mixture.sizes, mixture.weights, 6, 4, seed=2)
    order = mixture.order(4, 2)
    expected = sorted(order.text_index(e) for e in range(24))
    assert sorted([*rows[0], *(20 + r for r in rows[1])]) == sorted(set(expected))


def test_unimae_mine_writes_the_same_pairs_with_negatives_and_resumes(tmp_model_pairs):
    from unimae.cli import main

    tiny, data, out = tmp_model_pairs
    base = ["mine", "--model", str(tiny), "--precision", "fp32", "--data", data, "--output-dir", str(out)]
    assert main([*base, "--symmetric-sources", "b", "--max-length", "16"]) == 0
    for name in ("a", "b"):
        original, mined = load_pairs(f"{data.split(',')[0][:-7]}{name}.jsonl"), load_pairs(out / f"{name}.jsonl")
        assert [(p["query"], p["positive"]) for p in mined] == [(p["query"], p["positive"]) for p in original]
        assert all(p.get("negative") not in (p["query"], p["positive"]) for p in mined)
    assert load_pairs(out / "b.jsonl")[0]["negative"] == "unrelated text 0"  # its own, kept
    record = json.loads((out / "mining.json").read_text())
    a = record["sources"]["a"]
    assert a["asked"] == 12 and a["mined"] + a["none_found"] == 12 and a["mined"] > 0
    assert sum("negative" in p for p in load_pairs(out / "a.jsonl")) == a["mined"]
    assert record["settings"]["symmetric_sources"] == ["b"]
    before = (out / "a.jsonl").stat().st_mtime_ns
    assert main([*base, "--symmetric-sources", "b", "--max-length", "16"]) == 0  # finished sources skipped
    assert (out / "a.jsonl").stat().st_mtime_ns == before
    assert main([*base, "--symmetric-sources", "b", "--max-length", "16", "--relative-margin", "0.2"]) == 2


def test_unimae_mine_with_steps_mines_only_the_drawn_pairs(tmp_model_pairs):
    from unimae.cli import main

    tiny, data, out = tmp_model_pairs
    args = ["mine", "--model", str(tiny), "--precision", "fp32", "--data", data, "--output-dir", str(out)]
    assert main([*args, "--max-length", "16", "--steps", "1", "--train-batch-size", "4"]) == 0
    record = json.loads((out / "mining.json").read_text())
    assert sum(s["asked"] for s in record["sources"].values()) == 4
    mined = sum("negative" in p for p in load_pairs(out / "a.jsonl")) + sum(
        "negative" in p for p in load_pairs(out / "b.jsonl")
    )
    assert mined == 3 + sum(s["mined"] for s in record["sources"].values())  # b's 3 given ones stay


@pytest.fixture
def tmp_model_pairs(tiny_model_dirs, tmp_path):
    a = _write_pairs(tmp_path / "a.jsonl", 12)
    b = _write_pairs(tmp_path / "b.jsonl", 9, negative_every=4)
    return tiny_model_dirs["llama"], f"{a},{b}", tmp_path / "mined"
