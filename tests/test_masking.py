"""Mask invariants (Eq. 1 and Eq. 4), element by element."""

import torch

from unimae.data.masking import UniMAECollator, example_generator, mar_corrupt, mrc_visibility


def test_mrc_diagonal_hidden_eos_visible_pads_hidden():
    visible = mrc_visibility(n_tokens=5, width=8, p_mrc=0.5, gen=example_generator(0, 3))  # (8, 9)
    assert visible.shape == (8, 9)
    assert visible[:, 0].all(), "h_eos key must always be visible"
    for i in range(8):
        assert not visible[i, i + 1], f"query {i} sees its own token"
    assert not visible[:, 1 + 5 :].any(), "pad keys must be hidden"


def test_mrc_hidden_share_matches_p_mrc():
    visible = mrc_visibility(n_tokens=200, width=200, p_mrc=0.3, gen=example_generator(0, 1))
    off_diagonal = visible[:, 1:][~torch.eye(200, dtype=torch.bool)]
    assert abs(off_diagonal.float().mean().item() - 0.7) < 0.02


def test_mar_never_masks_bos_or_eos_and_rate_matches():
    ids = [1] + list(range(10, 1010)) + [2]
    out = mar_corrupt(ids, p_mar=0.5, mask_id=99, keep_first=True, gen=example_generator(0, 0))
    assert out[0] == 1 and out[-1] == 2
    masked = sum(o == 99 for o in out[1:-1]) / 1000
    assert 0.45 < masked < 0.55
    assert all(o in (99, i) for o, i in zip(out, ids, strict=True))


def test_mar_zero_rate_is_identity():
    ids = [5, 6, 7, 2]
    assert mar_corrupt(ids, 0.0, 99, False, example_generator(0, 0)) == ids


def test_collator_masks_depend_only_on_example_index():
    collate = UniMAECollator(pad_id=0, mask_id=99, bos_id=1, p_mar=0.5, p_mrc=0.5, seed=7)
    a = [1, 10, 11, 12, 13, 2]
    b = [1, 20, 21, 2]
    together = collate([a, b], [4, 5])
    alone = collate([b], [5])
    assert torch.equal(together.corrupted_ids[1, :4], alone.corrupted_ids[0])
    assert torch.equal(together.mrc_visible[1, :4, :5], alone.mrc_visible[0, :4, :5])
    assert together.attention_mask.tolist() == [[1] * 6, [1] * 4 + [0, 0]]
    assert (together.corrupted_ids[1, 4:] == 0).all(), "pads are never corrupted"
    assert not together.mrc_visible[1, :, 5:].any(), "pad keys of the short text are hidden"
