"""Attention-mask rules as explicit (B, T, T) tensors, handed to any transformers model as a 4D mask.

transformers passes a ready 4D ``attention_mask`` straight to the attention implementation, for every
architecture (Llama, Gemma3, Qwen2 ...), so a rule here needs no per-model code, with one exception: a ready
mask also bypasses the window of sliding-window layers (Gemma-3: 512 tokens), so for a model with such
layers and a sequence longer than the window :func:`to_model_mask` gives one mask per layer type (a dict,
which those models take), the window applied to the sliding layers' mask.

- ``causal``: the model's own mask (nothing is built; the 2D padding mask is passed through);
- ``bidirectional`` (LLM2Vec/MNTP): every real token sees every real token;
- ``gem`` (GEM): causal, but tokens after the summary tokens cannot see the text before them, and
  summary tokens cannot see each other (each sees the prefix and itself);
- branches (lm-eval scoring): continuations packed after their shared context, each seeing the
  context and itself only.

``allowed[b, i, j]`` is True where query i may attend to key j. Padding rows see only themselves, so no
row is empty (an empty row makes SDPA return NaN).
"""

from __future__ import annotations

import torch

ATTENTION_RULES = ("causal", "bidirectional", "gem")


def causal_allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask (B, T) 1 = real -> (B, T, T) bool: causal over real tokens."""
    t = attention_mask.shape[1]
    tril = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    real = attention_mask.bool()
    return tril[None] & real[:, None, :] & real[:, :, None]  # (B, T, T)


def bidirectional_allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask (B, T) -> (B, T, T) bool: every real token sees every real token."""
    real = attention_mask.bool()
    return real[:, None, :] & real[:, :, None]  # (B, T, T)


def gem_allowed(attention_mask: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """GEM mask. summary (B, T) bool marks summary tokens (one contiguous block per row, or none).

    Starting from causal: (1) a token after the block cannot see tokens before the block;
    (2) a summary token cannot see the other summary tokens. Rows without summary tokens stay causal.
    """
    allowed = causal_allowed(attention_mask)  # (B, T, T)
    t = attention_mask.shape[1]
    pos = torch.arange(t, device=attention_mask.device)
    has = summary.any(1)  # (B,)
    first = torch.where(has, summary.float().argmax(1), torch.full_like(has, t, dtype=torch.long))  # (B,)
    last = torch.where(has, t - 1 - summary.flip(1).float().argmax(1), torch.full_like(first, t))  # (B,)
    after = pos[None] > last[:, None]  # (B, T) query rows after the block
    before = pos[None] < first[:, None]  # (B, T) key columns before the block
    allowed &= ~(after[:, :, None] & before[:, None, :])
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)[None]
    allowed &= ~(summary[:, :, None] & summary[:, None, :] & ~eye)
    return allowed


def branches_allowed(segments: torch.Tensor) -> torch.Tensor:
    """Causal attention over a shared prefix and branches packed after it (several continuations of one
    context scored in one row). segments (B, T) long: 0 = the prefix, j >= 1 = branch j (contiguous), -1 =
    padding -> (B, T, T) bool: query i sees key k <= i if k is in the prefix or in i's own branch."""
    t = segments.shape[1]
    tril = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()  # (T, T)
    query, key = segments[:, :, None], segments[:, None, :]  # (B, T, 1), (B, 1, T)
    return tril[None] & (query >= 0) & ((key == 0) | (key == query))  # (B, T, T)


def to_model_mask(allowed: torch.Tensor, model) -> torch.Tensor | dict[str, torch.Tensor]:
    """(B, T, T) bool -> the 4D mask the model's attention implementation takes: (B, 1, T, T); for a model
    with sliding-window layers and T over the window, ``{"full_attention": mask, "sliding_attention": mask}``
    where the sliding mask also hides keys ``window`` or more tokens away from the query (rows of contiguous
    tokens; lm-eval's packed rows are never longer than the window, ``ScoredLM``)."""
    t = allowed.shape[1]
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=allowed.device)[None]  # no empty rows
    window = sliding_window(model)
    if window is None or t <= window:
        return _kernel_mask(allowed, model)
    pos = torch.arange(t, device=allowed.device)  # (T,)
    near = (pos[:, None] - pos[None, :]).abs() < window  # (T, T)
    return {"full_attention": _kernel_mask(allowed, model), "sliding_attention": _kernel_mask(allowed & near, model)}


def sliding_window(model) -> int | None:
    """The window of ``model``'s sliding-window layers (transformers' ``config.layer_types``), None without."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return getattr(config, "sliding_window", None)


def _kernel_mask(allowed: torch.Tensor, model) -> torch.Tensor:
    """(B, T, T) bool -> (B, 1, T, T): bool for SDPA and the like, additive float for eager."""
    implementation = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    if implementation == "eager":  # eager adds the mask to the scores
        additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
    return allowed[:, None]


def model_attention_mask(rule: str, attention_mask: torch.Tensor, model, summary: torch.Tensor | None = None):
    """The ``attention_mask`` argument for ``model`` under ``rule`` (the 2D mask itself for 'causal')."""
    if rule == "causal":
        return attention_mask
    if rule == "bidirectional":
        return to_model_mask(bidirectional_allowed(attention_mask), model)
    if rule == "gem":
        if summary is None:
            raise ValueError("the gem attention rule needs the summary-token positions")
        return to_model_mask(gem_allowed(attention_mask, summary), model)
    raise ValueError(f"unknown attention rule {rule!r}; choose one of {ATTENTION_RULES}")


def set_attention_dropout(model: torch.nn.Module, p: float) -> int:
    """Set the attention-probability dropout of every attention layer of ``model`` (used in train mode only).

    transformers' attention modules (Llama, Qwen2, Gemma3, ...) copy ``config.attention_dropout`` into an
    ``attention_dropout`` attribute at construction and pass it to the attention kernel while training, so
    setting the attribute works for any such architecture. Returns how many layers were set.
    """
    layers = [m for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)]
    if p > 0 and not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer with an attention_dropout to set")
    for layer in layers:
        layer.attention_dropout = float(p)
    return len(layers)
