"""Masked Re-Construct loss (UniMAE Eq. 3-5) and the tiny decoder it owns.

The tiny decoder rebuilds the ORIGINAL tokens from ``h_eos``:
- queries ``H1 = [h_eos + p_1, ..., h_eos + p_N]`` (query i predicts x_i)   (Eq. 3)
- keys/values ``H2 = [h_eos, e_{x_1} + p_1, ..., e_{x_N} + p_N]``           (Eq. 3)
- attention restricted by the Bernoulli mask M of ``unimae.data.masking``         (Eq. 4)
- logits through the LLM's output head; ``L_MRC = sum_i CE(x_i | ...)``     (Eq. 5)
Every position of the text is a target, BOS and EOS included (the paper rebuilds "the original text";
a BOS target is trivial). Token embeddings and the output head are detached, so L_MRC reaches the LLM only
through ``h_eos``. The decoder is thrown away after training (kept beside the adapter only to resume).

Positions (``positions="scaled"``, the default): Eq. 3 adds a trainable ``p_i`` to ``h_eos`` so that query
i asks for token i. On SmolLM2-135M ``h_eos`` has an RMS of about 2 per dimension (Gemma-3-270M about 3.3,
with outliers near 30) while the old ``p_i`` started at N(0, 0.02): ``h_eos + p_i`` was the same vector for
every query (decoder outputs at positions 1 and 20 have cosine 0.9997 at initialisation on Wikipedia
paragraphs; ``recipes/probe_decoder.py``), and MRC degenerated into predicting the text's bag of words
from ``h_eos``. So ``h_eos`` and the token embeddings are RMS-normalised (no weights) before the positions
are added, and ``p_i`` starts at N(0, 1): each part of ``h_eos + p_i`` has unit RMS, and queries at
different positions differ from the first step (cosine 0.48 in the same probe). ``positions="legacy"``
keeps the old behaviour, to reproduce earlier numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unimae.losses.cross_entropy import chunked_cross_entropy, output_projection, per_example_mean

POSITION_MODES = ("scaled", "legacy")


class TinyDecoder(nn.Module):
    """One pre-norm transformer layer (attention + SwiGLU MLP) with learned positions.

    h_eos: (B, D); token_embeds: (B, T, D) embeddings of the original tokens;
    visible: (B, T, T + 1) bool key visibility (True = attend) -> (B, T, D).
    ``positions``: "scaled" (inputs RMS-normalised, p_i ~ N(0, 1)) or "legacy" (raw inputs, p_i ~ N(0, 0.02)).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        max_positions: int,
        eps: float = 1e-6,
        positions: str = "scaled",
    ):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        self.num_heads, self.scaled, self.eps = num_heads, positions == "scaled", eps
        self.positions = nn.Embedding(max_positions, hidden_size)
        self.query_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.key_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.out_norm = nn.RMSNorm(hidden_size, eps=eps)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        if self.scaled:
            nn.init.normal_(self.positions.weight, std=1.0)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """Unit RMS per vector (no weights) in "scaled" mode; unchanged in "legacy"."""
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) if self.scaled else x

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)  # (B, H, t, d/H)

    def forward(self, h_eos: torch.Tensor, token_embeds: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        b, t, d = token_embeds.shape
        if t > self.positions.num_embeddings:
            raise ValueError(f"{t} tokens exceed the tiny decoder's {self.positions.num_embeddings} positions")
        pos = self.positions.weight[:t]  # (T, D)
        h = self._scale(h_eos)[:, None, :]  # (B, 1, D)
        queries = h + pos  # (B, T, D) H1
        keys = torch.cat([h, self._scale(token_embeds) + pos], dim=1)  # (B, T + 1, D) H2
        q = self._heads(self.q_proj(self.query_norm(queries)))  # (B, H, T, d/H)
        kv_in = self.key_norm(keys)
        k = self._heads(self.k_proj(kv_in))  # (B, H, T + 1, d/H)
        v = self._heads(self.v_proj(kv_in))  # (B, H, T + 1, d/H)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None])  # (B, H, T, d/H)
        x = queries + self.o_proj(attn.transpose(1, 2).reshape(b, t, d))  # (B, T, D)
        m = self.mlp_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))  # (B, T, D)
        return self.out_norm(x)


class MRCLoss(nn.Module):
    """Eq. 5 reconstruction loss; owns the tiny decoder (saving the LLM never writes it).

    h_eos: (B, D); input_ids, attention_mask: (B, T); visible: (B, T, T + 1);
    input_embeddings / output_head: the LLM's (used detached). Output: scalar.
    """

    def __init__(self, decoder: TinyDecoder, chunk_size: int = 1024, softcap: float | None = None):
        super().__init__()
        self.decoder = decoder
        self.chunk_size = chunk_size
        self.softcap = softcap

    def forward(
        self,
        h_eos: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        visible: torch.Tensor,
        input_embeddings: nn.Module,
        output_head: nn.Module,
    ) -> torch.Tensor:
        with torch.no_grad():
            token_embeds = input_embeddings(input_ids)  # (B, T, D) e_x of the original tokens
        out = self.decoder(h_eos, token_embeds.to(h_eos.dtype), visible)  # (B, T, D)
        real = attention_mask.bool()  # (B, T) pad queries carry no loss
        example = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(real)[real]
        weight, bias = output_projection(output_head)  # (V, D), (V,) or None: detached, as in Eq. 5
        bias = bias.detach() if bias is not None else None
        losses = chunked_cross_entropy(
            out[real], weight.detach(), input_ids[real], self.chunk_size, bias, self.softcap
        )  # (n,)
        return per_example_mean(losses, example, input_ids.shape[0])
