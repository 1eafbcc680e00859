"""Attention rules: masks element by element, and that every architecture obeys a 4D mask."""

import torch

from unimae.embedding.attention import (
    bidirectional_allowed,
    causal_allowed,
    gem_allowed,
    model_attention_mask,
    sliding_window,
    to_model_mask,
)
from unimae.models import load_model


def test_gem_mask_element_by_element():
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    summary = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)  # text 0-1, summary 2-3, text 4-6, pad 7
    allowed = gem_allowed(mask, summary)[0]
    causal = causal_allowed(mask)[0]
    for i in range(8):
        for j in range(8):
            expected = bool(causal[i, j])
            if i >= 4 and j < 2:  # text after the summary tokens cannot see the text before them
                expected = False
            if i in (2, 3) and j in (2, 3) and i != j:  # summary tokens cannot see each other
                expected = False
            assert bool(allowed[i, j]) == expected, (i, j)
    assert allowed[2, :2].all() and allowed[3, :2].all(), "summary tokens read the prefix"
    assert allowed[5, 2] and allowed[5, 3] and allowed[5, 4], "later text reads the summary tokens"
    assert not allowed[:, 7].any(), "nobody sees the pad"
    plain = gem_allowed(mask, torch.zeros_like(summary))
    assert torch.equal(plain, causal_allowed(mask)), "rows without summary tokens stay causal"


def test_bidirectional_mask_element_by_element():
    allowed = bidirectional_allowed(torch.tensor([[1, 1, 1, 0]]))[0]
    assert allowed[:3, :3].all() and not allowed[:, 3].any() and not allowed[3].any()


def test_models_follow_4d_masks(tiny_dir):
    model, _, _ = load_model(str(tiny_dir))
    ids = torch.tensor([[5, 9, 14, 20, 7, 0], [11, 6, 8, 10, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    decoder = model.get_decoder()
    with torch.no_grad():
        plain = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        causal = decoder(input_ids=ids, attention_mask=to_model_mask(causal_allowed(mask), model)).last_hidden_state
        bi = decoder(input_ids=ids, attention_mask=model_attention_mask("bidirectional", mask, model)).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(causal[real], plain[real], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(bi).all()
    # the last real token already sees everything causally; earlier tokens change once they see the future
    assert (bi[0, 0] - plain[0, 0]).abs().max() > 1e-3
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = decoder(input_ids=ids, attention_mask=model_attention_mask("bidirectional", mask, model))
    torch.testing.assert_close(eager.last_hidden_state[real], bi[real], rtol=1e-4, atol=1e-4)


def test_a_ready_mask_keeps_sliding_window_layers_windowed(tiny_dir):
    """Gemma-3's sliding layers (window 8 in the tiny model) skip their window for a ready 4D mask, so a mask
    over more tokens than the window must carry it: causal as a 4D mask equals the model's own causal mask."""
    model, _, _ = load_model(str(tiny_dir))
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    decoder = model.get_decoder()
    with torch.no_grad():
        plain = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        causal = decoder(input_ids=ids, attention_mask=to_model_mask(causal_allowed(mask), model)).last_hidden_state
        gem = model_attention_mask("gem", mask, model, summary=torch.zeros_like(mask, dtype=torch.bool))
        no_summary = decoder(input_ids=ids, attention_mask=gem).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(causal[real], plain[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(no_summary[real], plain[real], rtol=1e-4, atol=1e-4)
    if sliding_window(model) is not None:  # the sliding layers' mask: nothing 8 or more positions away
        sliding = model_attention_mask("bidirectional", mask, model)["sliding_attention"][1, 0]
        assert sliding[19, 12] and not sliding[19, 11] and sliding[0, 7] and not sliding[0, 8]
