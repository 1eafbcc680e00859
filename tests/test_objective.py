"""The UniMAE objective on tiny random Llama / Gemma3 / Qwen2 models."""

import torch
from conftest import SENTENCES
from peft import LoraConfig, get_peft_model

from unimae.data.masking import UniMAECollator
from unimae.embedding.tokenization import choose_mask_token, encode_with_eos
from unimae.losses import UniMAEObjective
from unimae.models import load_model


def _objective(tiny_dir, alpha=0.1):
    model, tokenizer, _ = load_model(str(tiny_dir))
    llm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    _, mask_id = choose_mask_token(tokenizer)
    collate = UniMAECollator(tokenizer.pad_token_id, mask_id, tokenizer.bos_token_id, 0.5, 0.5, seed=0)
    return UniMAEObjective(llm, alpha, max_positions=32, chunk_size=16), tokenizer, collate


def test_joint_loss_is_alpha_mar_plus_mrc(tiny_dir):
    objective, tokenizer, collate = _objective(tiny_dir, alpha=0.1)
    batch = collate(encode_with_eos(tokenizer, SENTENCES[:4], 32), [0, 1, 2, 3])
    out = objective(batch)
    assert set(out) == {"loss", "mar", "mrc"}
    assert all(v.ndim == 0 and torch.isfinite(v) for v in out.values())
    torch.testing.assert_close(out["loss"].detach(), 0.1 * out["mar"] + out["mrc"])


def test_lora_and_decoder_get_gradients_base_does_not(tiny_dir):
    objective, tokenizer, collate = _objective(tiny_dir)
    batch = collate(encode_with_eos(tokenizer, SENTENCES[:2], 32), [0, 1])
    objective(batch)["loss"].backward()
    named = dict(objective.named_parameters())
    lora = [n for n in named if "lora_" in n]
    assert lora and all(named[n].grad is not None for n in lora)
    assert all(p.grad is not None for p in objective.mrc.decoder.parameters())
    frozen = [p for n, p in named.items() if "lora_" not in n and not n.startswith("mrc.")]
    assert all(p.grad is None for p in frozen)


def test_loss_decreases_when_overfitting(tiny_dir):
    torch.manual_seed(0)
    objective, tokenizer, collate = _objective(tiny_dir, alpha=1.0)
    batch = collate(encode_with_eos(tokenizer, SENTENCES[:4], 32), [0, 1, 2, 3])
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    first = None
    for _ in range(40):
        out = objective(batch)
        first = first if first is not None else {k: v.item() for k, v in out.items()}
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert out["loss"].item() < 0.9 * first["loss"]
    assert out["mar"].item() < first["mar"] and out["mrc"].item() < first["mrc"]


def test_train_mask_token_trains_only_that_embedding_row(tiny_model_dirs, tmp_path):
    from unimae.adapter import load_with_adapter
    from unimae.embedding.tokenization import choose_mask_token
    from unimae.models import load_model
    from unimae.training.config import TrainConfig
    from unimae.training.methods import UniMAEOptions
    from unimae.training.trainer import train

    tiny = str(tiny_model_dirs["llama"])
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SENTENCES[:4]) + "\n")
    config = TrainConfig(
        model=tiny, data=str(corpus), output_dir=str(tmp_path / "run"), steps=3, batch_size=4, micro_batch_size=4,
        max_length=24, save_every=0, precision="fp32", lora_r=4, lora_alpha=8, lr=1e-2,
        options=UniMAEOptions(train_mask_token=True),
    )  # fmt: skip
    result = train(config)
    base, tokenizer, _ = load_model(tiny, dtype=torch.float32)
    before = base.get_input_embeddings().weight.detach().clone()
    _, mask_id = choose_mask_token(tokenizer, "auto")
    trained, _, _ = load_with_adapter(tiny, result.adapter_dir, torch.float32, merge=True)
    after = trained.get_input_embeddings().weight.detach()
    changed = (after != before).any(1).nonzero().flatten().tolist()
    assert changed == [mask_id]


def test_clean_mrc_input_equals_corrupted_when_nothing_is_masked(tiny_model_dirs):
    """mrc_input='clean' only moves h_eos to a pass over the uncorrupted text; at p_mar = 0 the two agree."""
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    _, mask_id = choose_mask_token(tokenizer, "auto")
    rows = encode_with_eos(tokenizer, SENTENCES[:3], 24)
    clean = UniMAECollator(tokenizer.pad_token_id, mask_id, tokenizer.bos_token_id, 0.0, 0.5, seed=0)(rows, [0, 1, 2])
    noisy = UniMAECollator(tokenizer.pad_token_id, mask_id, tokenizer.bos_token_id, 0.6, 0.5, seed=0)(rows, [0, 1, 2])
    losses = {}
    for name, batch in (("p0", clean), ("p06", noisy)):
        for mode in ("corrupted", "clean"):
            torch.manual_seed(0)
            losses[name, mode] = UniMAEObjective(model, 0.1, 24, mrc_input=mode)(batch)
    torch.testing.assert_close(losses["p0", "clean"]["loss"], losses["p0", "corrupted"]["loss"])
    assert losses["p06", "clean"]["mar"] == losses["p06", "corrupted"]["mar"], "MAR always sees the corrupted text"
    assert losses["p06", "clean"]["mrc"] != losses["p06", "corrupted"]["mrc"]
