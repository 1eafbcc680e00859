"""Loss shapes, chunking and the gradient path of L_MRC."""

import pytest
import torch

from unimae.data.masking import UniMAECollator
from unimae.losses import MRCLoss, TinyDecoder, chunked_cross_entropy, per_example_mean


@pytest.mark.parametrize("recompute_above_mb", [0.0, 1024.0])  # recompute every chunk / keep them all
def test_chunked_ce_equals_full_ce_values_and_grads(recompute_above_mb):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, recompute_above_mb=recompute_above_mb)
    full = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    assert chunked.shape == (37,)
    torch.testing.assert_close(chunked, full)
    g1 = torch.autograd.grad(chunked.sum(), (hidden, weight))
    g2 = torch.autograd.grad(full.sum(), (hidden, weight))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_ce_recomputes_logits_only_above_its_memory_budget(monkeypatch):
    import unimae.losses.cross_entropy as ce

    calls = []
    original = ce._chunk_loss
    monkeypatch.setattr(ce, "_chunk_loss", lambda *a: calls.append(1) or original(*a))
    hidden, weight = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16)
    targets = torch.randint(0, 50, (37,))
    budget_mb = 37 * 50 * 4 / 2**20  # exactly this call's fp32 log-probabilities: kept, not recomputed
    for budget, forward_and_backward in ((budget_mb, 5), (budget_mb * 0.99, 10)):  # 5 chunks of 8 rows
        calls.clear()
        ce.chunked_cross_entropy(hidden, weight, targets, chunk_size=8, recompute_above_mb=budget).sum().backward()
        assert len(calls) == forward_and_backward


def test_per_example_mean_weights_examples_equally():
    losses = torch.tensor([1.0, 1.0, 1.0, 4.0])
    example = torch.tensor([0, 0, 0, 1])
    assert per_example_mean(losses, example, 2).item() == pytest.approx(2.5)


def test_tiny_decoder_shapes_and_no_self_copy():
    dec = TinyDecoder(hidden_size=32, num_heads=4, intermediate_size=64, max_positions=16)
    h_eos = torch.randn(3, 32)
    tokens = torch.randn(3, 10, 32)
    visible = torch.ones(3, 10, 11, dtype=torch.bool)
    assert dec(h_eos, tokens, visible).shape == (3, 10, 32)
    only_eos = torch.zeros(3, 10, 11, dtype=torch.bool)
    only_eos[:, :, 0] = True
    out1 = dec(h_eos, tokens, only_eos)
    out2 = dec(h_eos, torch.randn(3, 10, 32), only_eos)
    torch.testing.assert_close(out1, out2)  # with only h_eos visible, token keys must not matter


def test_mrc_gradient_reaches_llm_only_through_h_eos():
    torch.manual_seed(0)
    vocab, dim = 30, 16
    embed = torch.nn.Embedding(vocab, dim)
    head = torch.nn.Linear(dim, vocab, bias=False)
    loss_fn = MRCLoss(TinyDecoder(dim, 2, 32, 8), chunk_size=4)
    collate = UniMAECollator(pad_id=0, mask_id=29, bos_id=None, p_mar=0.5, p_mrc=0.5, seed=0)
    batch = collate([[3, 4, 5, 2], [6, 7, 2]], [0, 1])
    h_eos = torch.randn(2, dim, requires_grad=True)
    loss = loss_fn(h_eos, batch.input_ids, batch.attention_mask, batch.mrc_visible, embed, head)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert h_eos.grad is not None and h_eos.grad.abs().sum() > 0
    assert embed.weight.grad is None and head.weight.grad is None


def test_tiny_decoder_queries_differ_by_position_even_when_h_eos_is_large():
    """Eq. 3: query i = h_eos + p_i must ask for token i. With h_eos at the scale of a real LLM's
    last layer (RMS ~2-3 per dimension), the old N(0, 0.02) positions vanished next to it."""
    torch.manual_seed(0)
    h_eos = 3.0 * torch.randn(2, 64)  # (B, D) like Gemma's h_eos scale
    tokens = torch.randn(2, 6, 64)  # (B, T, D)
    visible = torch.ones(2, 6, 7, dtype=torch.bool)

    def position_cosine(positions: str) -> float:
        torch.manual_seed(1)
        out = TinyDecoder(64, 4, 128, 16, positions=positions)(h_eos, tokens, visible)  # (B, T, D)
        return torch.nn.functional.cosine_similarity(out[:, 0], out[:, 3], dim=-1).min().item()

    assert position_cosine("legacy") > 0.99, "the old decoder gave every position (almost) the same output"
    assert position_cosine("scaled") < 0.9, "queries at different positions must differ"
    with pytest.raises(ValueError, match="positions must be one of"):
        TinyDecoder(64, 4, 128, 16, positions="rope")


def test_uniform_p_mar_sampling_varies_the_rate_per_row():
    ids = [list(range(2, 102))] * 8  # 8 rows of 100 tokens, EOS-less is fine for corruption counts
    fixed = UniMAECollator(0, 1, None, p_mar=0.5, p_mrc=0.5, seed=0)(ids, list(range(8)))
    uniform = UniMAECollator(0, 1, None, p_mar=0.5, p_mrc=0.5, seed=0, p_mar_sampling="uniform")(ids, list(range(8)))
    rate_fixed = (fixed.corrupted_ids == 1).float().mean(1)  # (8,)
    rate_uniform = (uniform.corrupted_ids == 1).float().mean(1)  # (8,)
    assert ((rate_fixed - 0.5).abs() < 0.2).all()
    assert rate_uniform.min() < 0.2 and rate_uniform.max() > rate_uniform.min() + 0.15 and rate_uniform.max() <= 0.6
