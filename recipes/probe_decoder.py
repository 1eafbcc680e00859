"""Probe the MRC tiny decoder at initialisation on real SmolLM2-135M states: do its queries differ by position?

Prints, for --mrc-positions legacy and scaled: the RMS of h_eos, the mean cosine between the decoder outputs at
positions 1 and 20 (1.0 = the decoder cannot tell positions apart) and the MRC loss at initialisation.
    .venv/bin/python recipes/probe_decoder.py
"""

import json

import torch

from unimae.data.corpus import load_texts
from unimae.data.masking import UniMAECollator
from unimae.embedding.tokenization import choose_mask_token, encode_with_eos, last_token_index
from unimae.losses.unimae import UniMAEObjective
from unimae.models import load_model

torch.manual_seed(0)
model, tok, _ = load_model("smollm2-135m", dtype=torch.float32)
texts = load_texts("enwiki-gensim")[:8]
_, mask_id = choose_mask_token(tok, "auto")
batch = UniMAECollator(tok.pad_token_id, mask_id, tok.bos_token_id, 0.5, 0.5, 0)(
    encode_with_eos(tok, texts, 64, warn=False), list(range(8))
)
out = {}
for mode in ("legacy", "scaled"):
    torch.manual_seed(0)
    obj = UniMAEObjective(model, 0.1, 64, mrc_positions=mode).eval()
    with torch.no_grad():
        hidden = model.get_decoder()(
            input_ids=batch.corrupted_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        h = hidden[torch.arange(8), last_token_index(batch.attention_mask)]
        emb = model.get_input_embeddings()(batch.input_ids)
        dec = obj.mrc.decoder(h, emb, batch.mrc_visible)  # (B, T, D)
        cos = torch.nn.functional.cosine_similarity(dec[:, 1], dec[:, 20], dim=-1).mean().item()
        loss = obj(batch)
    out[mode] = {
        "h_eos_rms": h.pow(2).mean().sqrt().item(),
        "cos_pos1_pos20": round(cos, 4),
        "mrc_init": round(loss["mrc"].item(), 3),
    }
print(json.dumps(out))
