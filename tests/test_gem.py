"""GEM's recipe (METHOD.md section 2) on tiny random Llama / Gemma3 / Qwen2 models: prefix-dropout positives,
the learnable logit scale, the two-phase learning rate, new summary tokens whose rows alone are trained,
saved and loaded again. The attention mask itself is checked element by element in test_attention.py."""

import math

import numpy as np
import pytest
import torch
from conftest import SENTENCES, read_log, tiny_train_config
from safetensors import safe_open

from unimae.adapter import load_with_adapter, quiet_peft
from unimae.embedding.spec import EmbeddingSpec
from unimae.encoder import Encoder
from unimae.models import load_model
from unimae.training.config import TrainConfig
from unimae.training.methods import Context, get_method, summary_tokens
from unimae.training.trainer import train


def _method(tokenizer, **overrides):
    config = TrainConfig.from_dict({"method": "gem", "max_length": 32, **overrides})
    config.validate()  # as the trainer does before it builds the method
    return get_method("gem")(config, Context(tokenizer, tokenizer.mask_token_id, EmbeddingSpec()))


def _train_config(tiny_dir, corpus_file, out, **overrides):
    gem = dict(method="gem", steps=4, gem_switch_step=2, gem_contrastive_lr_scale=1.0, num_summary_tokens=2)
    return tiny_train_config(tiny_dir, corpus_file, out, **{**gem, **overrides})


def _log(out):
    return read_log(out)


def _peft_llm(tiny_dir, method):
    """The model as the trainer builds it: base, ``prepare_model``, LoRA plus ``lora_extra``."""
    from peft import LoraConfig, get_peft_model

    model, _, _ = load_model(str(tiny_dir))
    model = method.prepare_model(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", **method.lora_extra())
    with quiet_peft():
        return get_peft_model(model, lora)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # with BOS, without BOS
def test_positives_differ_only_in_dropped_prefix_tokens(tiny_model_dirs, arch):
    _, tokenizer, _ = load_model(str(tiny_model_dirs[arch]))
    method = _method(tokenizer, num_summary_tokens=2, gem_prefix_dropout=0.2)
    block = method.summary_ids
    batch = method.collate(SENTENCES, list(range(len(SENTENCES))))
    b = len(SENTENCES)
    assert batch["view_ids"].shape[0] == 2 * b, "anchors, then one positive each"
    for row in range(b):
        anchor = batch["view_ids"][row][batch["view_mask"][row].bool()].tolist()
        positive = batch["view_ids"][b + row][batch["view_mask"][b + row].bool()].tolist()
        for ids, pool in ((anchor, batch["view_pool"][row]), (positive, batch["view_pool"][b + row])):
            assert ids[-2:] == block, "the block is appended at the end, as at inference"
            assert pool.nonzero().flatten().tolist() == list(range(len(ids) - 2, len(ids))), "pooled: the block"
        text, kept = anchor[:-2], positive[:-2]
        start = 1 if tokenizer.bos_token_id is not None and text[0] == tokenizer.bos_token_id else 0
        assert kept[:start] == text[:start], "BOS is never dropped"
        n = len(text) - start
        assert len(text) - len(kept) == min(n - 1, max(1, round(0.2 * n))), "round(share x n) tokens dropped"
        it = iter(text)
        assert all(token in it for token in kept), "the positive is the anchor with tokens deleted, order kept"
    again = method.collate(SENTENCES, list(range(len(SENTENCES))))
    assert torch.equal(again["view_ids"], batch["view_ids"]), "drops are a function of (seed, example index)"
    shifted = method.collate(SENTENCES, list(range(100, 100 + len(SENTENCES))))
    assert not torch.equal(shifted["view_ids"][b:], batch["view_ids"][b:]), "another example index, other drops"


def test_dropout_positives_repeat_the_anchor_under_model_dropout(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    paper = _method(tokenizer)
    assert (paper.attention_dropout, paper.lora_dropout) == (0.0, 0.0), "prefix positives: no model dropout"
    views = _method(tokenizer, gem_positives="dropout", dropout=0.1)
    batch = views.collate(SENTENCES[:4], [0, 1, 2, 3])
    assert torch.equal(batch["view_ids"][:4], batch["view_ids"][4:])
    assert views.attention_dropout == 0.1


def test_logit_scale_is_trained_and_clamped(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    method = _method(tokenizer, gem_switch_step=0)
    llm = _peft_llm(tiny_model_dirs["llama"], method)
    objective = method.build_objective(llm)
    assert objective.log_scale.requires_grad
    assert objective.logit_scale().item() == pytest.approx(20.0), "starts at 1 / temperature"
    batch = method.collate(SENTENCES[:4], [0, 1, 2, 3])
    losses = objective(batch)
    losses["loss"].backward()
    assert objective.log_scale.grad is not None and objective.log_scale.grad.abs() > 0
    before = objective.log_scale.item()
    torch.optim.AdamW([objective.log_scale], lr=1e-2).step()
    assert objective.log_scale.item() != before, "an optimizer step moves it"
    with torch.no_grad():
        objective.log_scale.fill_(math.log(1000.0))
    assert objective(batch)["logit_scale"].item() == pytest.approx(100.0), "clamped at 100"
    assert objective.log_scale.item() == pytest.approx(math.log(100.0)), "the parameter itself is clamped"
    objective.set_step(-1)  # NTP phase: unused, but in the graph with gradient 0 (DDP)
    objective.log_scale.grad = None
    objective(batch)["loss"].backward()
    assert objective.log_scale.grad == 0
    fixed = _method(tokenizer, gem_learn_logit_scale=False).build_objective(llm)
    assert not fixed.log_scale.requires_grad


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])  # tied, tied + scaled embedding, untied head
def test_summary_rows_get_gradient_and_nothing_else_in_the_embedding_changes(
    tiny_model_dirs, corpus_file, tmp_path, arch
):
    tiny = tiny_model_dirs[arch]
    base, base_tokenizer, _ = load_model(str(tiny))
    v0 = base.get_input_embeddings().weight.shape[0]
    _, tokenizer, _ = load_model(str(tiny))
    method = _method(tokenizer, num_summary_tokens=2, gem_plain_share=0.0, gem_switch_step=1)
    ids = method.summary_ids
    assert ids == [v0, v0 + 1], "two new tokens after the vocabulary"

    llm = _peft_llm(tiny, method)
    trainable = [n for n, p in llm.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(trainable) == 1 and "trainable_tokens_delta" in trainable[0], trainable
    objective = method.build_objective(llm)
    batch = method.collate(SENTENCES[:4], [0, 1, 2, 3])
    for step in (0, 1):  # NTP (every row has the block), then contrastive
        objective.set_step(step)
        llm.zero_grad()
        objective(batch)["loss"].backward()
        delta = dict(llm.named_parameters())[trainable[0]]
        assert delta.shape == (2, base.config.hidden_size)
        assert (delta.grad.abs().sum(1) > 0).all(), f"step {step}: both summary rows get gradient"
        assert llm.get_input_embeddings().token_adapter.base_layer.weight.grad is None, "the matrix is frozen"

    result = train(_train_config(tiny, corpus_file, tmp_path / "run"))
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as saved:
        shapes = {k: tuple(saved.get_slice(k).get_shape()) for k in saved.keys()}
    assert not any(shape[0] >= v0 for shape in shapes.values()), "no embedding matrix in the adapter"
    assert [s for k, s in shapes.items() if "trainable_tokens" in k] == [(2, base.config.hidden_size)]

    merged, loaded_tokenizer, _ = load_with_adapter(str(tiny), result.adapter_dir, torch.float32, merge=True)
    assert loaded_tokenizer.convert_tokens_to_ids(["<|summary_0|>", "<|summary_1|>"]) == ids
    assert len(base_tokenizer) < len(loaded_tokenizer), "the adapter's tokenizer, with the summary tokens"
    before, after = base.get_input_embeddings().weight, merged.get_input_embeddings().weight
    assert after.shape[0] == v0 + 2
    assert torch.equal(after[:v0], before), "no other row of the input embedding changes"
    init = before.float().mean(0)
    assert all((after[i] - init).abs().max() > 1e-4 for i in ids), "the summary rows were trained"
    head_before, head_after = base.get_output_embeddings().weight, merged.get_output_embeddings().weight
    assert torch.equal(head_after[:v0], head_before), "no other row of the output head changes"
    if not base.config.tie_word_embeddings:
        torch.testing.assert_close(head_after[v0:], head_before.float().mean(0).expand(2, -1))


def test_new_summary_tokens_load_for_inference(tiny_model_dirs, corpus_file, tmp_path):
    tiny = tiny_model_dirs["qwen2"]
    result = train(_train_config(tiny, corpus_file, tmp_path / "run"))
    merged = Encoder.from_pretrained(str(tiny), adapter=str(result.adapter_dir), precision="fp32")
    separate = Encoder.from_pretrained(str(tiny), adapter=str(result.adapter_dir), precision="fp32", merge=False)
    assert merged.spec.summary_ids == tuple(merged.tokenizer.convert_tokens_to_ids(["<|summary_0|>", "<|summary_1|>"]))
    np.testing.assert_allclose(separate.encode(SENTENCES[:3]), merged.encode(SENTENCES[:3]), atol=1e-4)

    base, tokenizer, _ = load_model(str(tiny))
    llm, _, _ = load_with_adapter(str(tiny), result.adapter_dir, torch.float32)
    ids = tokenizer(SENTENCES[:2], return_tensors="pt", padding=True)
    with torch.no_grad(), llm.disable_adapter():
        grown = llm(**ids).logits  # (B, T, V + 2)
    plain = base(**ids).logits.detach()  # (B, T, V)
    torch.testing.assert_close(grown[..., : plain.shape[-1]], plain, msg="adapter off: the base model's text logits")


def test_two_phase_learning_rate_and_exact_resume(tiny_model_dirs, corpus_file, tmp_path):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    method = _method(tokenizer, steps=10, gem_switch_step=4, gem_contrastive_lr_scale=0.1)
    factors = [method.lr_lambda(s) for s in range(10)]
    assert factors[:4] == [1.0] * 4, "NTP phase at --lr"
    assert factors[4] == pytest.approx(0.1), "then --lr x 0.1 (paper: 1e-4 -> 1e-5)"
    assert all(a > b > 0 for a, b in zip(factors[4:-1], factors[5:], strict=True)), "cosine decay to 0"
    assert _method(tokenizer, steps=10, gem_switch_step=4, gem_lr_schedule="constant").lr_lambda(9) == 1.0
    odd = _method(tokenizer, steps=10, gem_switch_step=4, gem_contrastive_lr_scale=0.3)
    expected = [1.0] * 4 + [0.3 * 0.5 * (1.0 + math.cos(math.pi * (s - 4) / 6)) for s in range(4, 10)]
    assert [odd.lr_lambda(s) for s in range(10)] == expected, "the same floats as before the schedule was shared"

    tiny = tiny_model_dirs["llama"]
    overrides = dict(steps=4, gem_switch_step=2, gem_contrastive_lr_scale=0.1)
    straight = train(_train_config(tiny, corpus_file, tmp_path / "straight", **overrides))
    train(_train_config(tiny, corpus_file, tmp_path / "resumed", **{**overrides, "steps": 2}))
    resumed = train(_train_config(tiny, corpus_file, tmp_path / "resumed", **overrides), resume=True)
    a, b = _log(tmp_path / "straight"), _log(tmp_path / "resumed")
    assert [r["lr"] for r in a] == pytest.approx([5e-3, 5e-3, 5e-4, 5e-4 * 0.5])  # the lr each step used
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y) and all(x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6) for k in ("loss", "lr"))
    assert "logit_scale" in a[-1] and "ntp" in a[0]
    state = torch.load(straight.output_dir / "checkpoints" / "step-000004" / "state.pt", weights_only=True)
    assert "log_scale" in state["trainable"], "the learnable scale is checkpointed"
    from safetensors.torch import load_file

    w1 = load_file(straight.adapter_dir / "adapter_model.safetensors")
    w2 = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)
    # past the switch, the cosine is under way: another --steps would bend the schedule the run has followed
    with pytest.raises(ValueError, match="steps 4 -> 6"):
        train(_train_config(tiny, corpus_file, tmp_path / "straight", **{**overrides, "steps": 6}), resume=True)


def test_spare_tokens_position_option_and_bad_flags(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    rows = model.get_input_embeddings().weight.shape[0]
    spare = _method(tokenizer, gem_summary_tokens="spare", num_summary_tokens=2)
    assert spare.summary_ids == summary_tokens(tokenizer, 2, "spare") and max(spare.summary_ids) < rows
    assert spare.prepare_model(model).get_input_embeddings().weight.shape[0] == rows, "no resize"
    assert spare.lora_extra() == {"trainable_token_indices": spare.summary_ids}
    old = _method(tokenizer, gem_summary_tokens="spare", gem_train_summary_rows=False)
    assert old.lora_extra() == {}, "the earlier behaviour: spare tokens, rows as pretrained"
    with pytest.raises(ValueError, match="must be trained"):
        _method(tokenizer, gem_train_summary_rows=False)
    with pytest.raises(ValueError, match="gem-prefix-dropout"):
        _method(tokenizer, gem_prefix_dropout=1.0)
    inner = _method(tokenizer, gem_plain_share=0.0, gem_block_position="inner", num_summary_tokens=1)
    batch = inner.collate(SENTENCES, list(range(len(SENTENCES))))
    for row in range(len(SENTENCES)):
        n = int(batch["attention_mask"][row].sum())
        at = int(batch["summary"][row].nonzero())
        assert 2 <= at <= n - 3, "after BOS + a text token; before a text token and EOS"
