"""Every training method on tiny random models: loss goes down on a tiny overfit, masks, chaining, bad input."""

import argparse
import json

import numpy as np
import pytest
import torch
from conftest import SENTENCES, read_log, tiny_train_config

from unimae.adapter import adapter_meta
from unimae.data.corpus import CorpusError
from unimae.embedding.spec import EmbeddingSpec
from unimae.encoder import Encoder
from unimae.losses.objective import Objective
from unimae.models import load_model
from unimae.training.config import TrainConfig, add_config_arguments
from unimae.training.methods import METHOD_REGISTRY, Context, Method, get_method, load_pairs, summary_tokens
from unimae.training.trainer import train


def _config(tiny_dir, data, out, **overrides):
    return tiny_train_config(tiny_dir, data, out, **overrides)


def _log(out):
    return read_log(out)


@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "four.txt"
    path.write_text("\n".join(SENTENCES[:4]) + "\n")  # one batch, every step: overfit
    return path


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"query": SENTENCES[i], "positive": SENTENCES[i + 4], "negative": SENTENCES[i + 8]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_registry_is_the_one_list_of_methods():
    assert set(METHOD_REGISTRY) >= {"unimae", "mntp", "simcse", "contrastive", "gem"}
    assert all(issubclass(cls, Method) and cls.name == name for name, cls in METHOD_REGISTRY.items())
    with pytest.raises(ValueError, match="unknown method"):
        get_method("bert")
    with pytest.raises(ValueError, match="unknown method 'bert'"):
        TrainConfig(method="bert").validate()
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert parser.parse_args(["--method", "gem"]).method == "gem"  # the CLI's choices come from the registry
    with pytest.raises(SystemExit):
        parser.parse_args(["--method", "bert"])


@pytest.mark.parametrize("name", ["unimae", "mntp", "simcse", "gem"])
def test_every_method_builds_an_objective_whose_batches_it_collates(tiny_model_dirs, name):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    config = TrainConfig(method=name, max_length=24)
    method = get_method(name)(config, Context(tokenizer, tokenizer.mask_token_id, EmbeddingSpec()))
    objective = method.build_objective(model)
    assert isinstance(objective, Objective) and objective.llm is model
    objective.set_step(0)
    batch = method.collate(SENTENCES[:3], [0, 1, 2])
    assert batch.num_tokens == int(batch["attention_mask"].sum()) > 0
    losses = objective(batch)
    assert losses["loss"].ndim == 0 and torch.isfinite(losses["loss"])
    assert isinstance(method.embedding_spec(), EmbeddingSpec)


@pytest.mark.parametrize(
    ("method", "key", "extra"),
    [
        ("mntp", "mntp", {"mntp_p_mask": 0.3}),
        ("simcse", "simcse", {"dropout": 0.1}),
        ("simcse", "simcse", {"dropout": 0.1, "dropout_on": "lora"}),
        ("contrastive", "contrastive", {}),
        ("gem", "ntp", {"gem_switch_step": 100, "gem_plain_share": 0.5}),
        ("gem", "contrastive", {"gem_switch_step": 0, "num_summary_tokens": 2}),
    ],
)
def test_each_method_overfits_and_records_how_it_embeds(
    tiny_dir, small_corpus, pairs_file, tmp_path, method, key, extra
):
    data = pairs_file if method == "contrastive" else small_corpus
    result = train(_config(tiny_dir, data, tmp_path / "run", method=method, **extra))
    log = _log(tmp_path / "run")
    first, last = np.mean([r[key] for r in log[:3]]), np.mean([r[key] for r in log[-3:]])
    assert last < first, (method, first, last)
    meta = adapter_meta(result.adapter_dir)
    assert meta.method == method
    expected = {"mntp": ("bidirectional", "mean"), "gem": ("gem", "summary")}.get(method, ("causal", "eos"))
    assert (meta.embedding.attention, meta.embedding.pooling) == expected
    enc = Encoder.from_pretrained(str(tiny_dir), adapter=str(result.adapter_dir), precision="fp32")
    assert (enc.attention, enc.pooling) == expected
    vectors = enc.encode(SENTENCES[:3])
    assert vectors.shape[0] == 3 and np.isfinite(vectors).all()


def test_simcse_after_unimae_chains_adapters(tiny_model_dirs, small_corpus, tmp_path):
    tiny = tiny_model_dirs["llama"]
    first = train(_config(tiny, small_corpus, tmp_path / "unimae", steps=2))
    second = train(
        _config(tiny, small_corpus, tmp_path / "simcse", steps=2, method="simcse", init_adapter=str(first.adapter_dir))
    )
    assert (second.adapter_dir / "init_adapter" / "adapter_config.json").is_file()
    both = Encoder.from_pretrained(str(tiny), adapter=str(second.adapter_dir), precision="fp32").encode(SENTENCES[:2])
    only_first = Encoder.from_pretrained(str(tiny), adapter=str(first.adapter_dir), precision="fp32").encode(
        SENTENCES[:2]
    )
    assert not np.allclose(both, only_first), "the SimCSE stage changed the embeddings"
    separate = Encoder.from_pretrained(str(tiny), adapter=str(second.adapter_dir), merge=False, precision="fp32")
    np.testing.assert_allclose(separate.encode(SENTENCES[:2]), both, atol=1e-4)


def test_mntp_then_simcse_keeps_bidirectional_mean(tiny_model_dirs, small_corpus, tmp_path):
    tiny = tiny_model_dirs["qwen2"]
    first = train(_config(tiny, small_corpus, tmp_path / "mntp", steps=2, method="mntp"))
    second = train(
        _config(tiny, small_corpus, tmp_path / "simcse", steps=2, method="simcse", init_adapter=str(first.adapter_dir))
    )
    enc = Encoder.from_pretrained(str(tiny), adapter=str(second.adapter_dir), precision="fp32")
    assert (enc.attention, enc.pooling) == ("bidirectional", "mean")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # with and without a BOS
def test_mntp_collator_masks_only_inner_tokens_and_targets_them(tiny_model_dirs, arch):
    _, tokenizer, _ = load_model(str(tiny_model_dirs[arch]))
    config = TrainConfig.from_dict({"method": "mntp", "mntp_p_mask": 0.5, "max_length": 32})
    mask_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else 5
    ctx = Context(tokenizer, mask_id, EmbeddingSpec())
    batch = get_method("mntp")(config, ctx).collate(SENTENCES[:4], [0, 1, 2, 3])
    changed = batch["corrupted_ids"] != batch["input_ids"]
    assert torch.equal(changed, batch["targets"]) and changed.any()
    assert (batch["corrupted_ids"][changed] == mask_id).all()
    real = batch["attention_mask"].bool()
    lengths = real.sum(1)
    for row, n in enumerate(lengths.tolist()):  # the first token has no position before it to predict it from
        assert not changed[row, 0] and not changed[row, n - 1], "the first token and EOS are never masked"


def test_gem_collator_inserts_summary_tokens_in_some_rows(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    ids = summary_tokens(tokenizer, 2)
    config = TrainConfig.from_dict({"method": "gem", "num_summary_tokens": 2, "gem_plain_share": 0.5, "max_length": 32})
    ctx = Context(tokenizer, tokenizer.mask_token_id, EmbeddingSpec())
    batch = get_method("gem")(config, ctx).collate(SENTENCES, list(range(len(SENTENCES))))
    with_summary = batch["summary"].any(1)
    assert 0 < int(with_summary.sum()) < len(SENTENCES), "some rows plain, some with summary tokens"
    for row in torch.nonzero(with_summary).flatten().tolist():
        where = torch.nonzero(batch["summary"][row]).flatten()
        assert where.tolist() == list(range(int(where[0]), int(where[0]) + 2)), "one contiguous block"
        assert batch["input_ids"][row, where].tolist() == ids and int(where[0]) >= 2, "after BOS + a token"
    assert (batch["view_ids"][batch["view_pool"].bool()].view(-1, 2) == torch.tensor(ids)).all()


def test_contrastive_data_errors(tmp_path, tiny_model_dirs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "positive": "b"}\n{"query": "c"}\n')
    with pytest.raises(CorpusError, match="line 2.*positive"):
        load_pairs(str(bad))
    with pytest.raises(CorpusError, match="contrastive needs"):
        load_pairs("enwiki-gensim")
    with pytest.raises(ValueError, match="micro_batch_size must be >= 2"):
        TrainConfig(method="simcse", micro_batch_size=1, batch_size=4).validate()
    with pytest.raises(ValueError, match="dropout_on"):
        TrainConfig.from_dict({"method": "simcse", "dropout_on": "hidden"}).validate()


def test_domain_post_training_mode_trains_all_weights(tiny_model_dirs, small_corpus, tmp_path):
    tiny = tiny_model_dirs["gemma3"]
    config = _config(tiny, small_corpus, tmp_path / "dpt", steps=3, full_params=True, p_mar=0.0, alpha=1.0, lr=1e-3)
    result = train(config)
    assert result.adapter_dir.name == "model" and (result.adapter_dir / "config.json").is_file()
    log = _log(tmp_path / "dpt")
    assert all(abs(r["loss"] - (r["mar"] + r["mrc"])) < 1e-4 for r in log), "alpha=1: L = L_MAR + L_MRC"
    base = Encoder.from_pretrained(str(tiny), precision="fp32").encode(SENTENCES[:2])
    tuned = Encoder.from_pretrained(str(result.adapter_dir), precision="fp32").encode(SENTENCES[:2])
    assert not np.allclose(base, tuned)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_simcse_views_differ_from_the_first_step(tiny_model_dirs, arch):
    """A fresh LoRA has B = 0, so only attention dropout can make SimCSE's two views of a text differ."""
    import torch

    from unimae.embedding.attention import set_attention_dropout
    from unimae.embedding.pooling import pooled_forward
    from unimae.models import load_model

    llm, tokenizer, _ = load_model(str(tiny_model_dirs[arch]), dtype=torch.float32)
    ids = tokenizer(["the cat sat on the mat"], return_tensors="pt")
    pool_mask = ids["attention_mask"]
    llm.train()

    def two_views():
        torch.manual_seed(0)
        return [pooled_forward(llm, ids["input_ids"], ids["attention_mask"], pool_mask) for _ in range(2)]

    assert set_attention_dropout(llm, 0.0) == llm.config.num_hidden_layers
    first, second = two_views()
    assert torch.equal(first, second)
    set_attention_dropout(llm, 0.3)
    first, second = two_views()
    assert not torch.allclose(first, second)
    llm.eval()  # inference ignores it
    a, b = (pooled_forward(llm, ids["input_ids"], ids["attention_mask"], pool_mask) for _ in range(2))
    assert torch.equal(a, b)


def test_attention_dropout_needs_attention_layers():
    import torch

    from unimae.embedding.attention import set_attention_dropout

    with pytest.raises(ValueError, match="no attention layer"):
        set_attention_dropout(torch.nn.Linear(2, 2), 0.1)
    assert set_attention_dropout(torch.nn.Linear(2, 2), 0.0) == 0
