"""The decoder's CPU fast path: a hand-written Llama step, oneDNN-packed bf16 weights, and the 16-bit and int8
weight copies of the decode precisions, with module-level state.

The first two are taken by :class:`~unimae.generation.decoding.Decoder` wherever they apply; neither changes a
number (tests/test_generation.py), only the time a step takes. The third is the one-token steps of the
decode precisions (``bf16-decode``, ``f16-decode``, ``int8-decode``, ``int8``: :mod:`unimae.runtime.precision`),
which round the weights (and under int8 the layers' inputs):

* for Llama-family models (chosen by ``config.model_type`` in :data:`LEAN_MODEL_TYPES`) the one-token steps
  run :class:`LlamaStep`, a flat loop over the layers with the same operations on the same modules
  (bit-identical logits in fp32; a bf16 step attends in fp32, faster than PyTorch's bf16 SDPA for one query
  on a CPU: :func:`~unimae.generation.kv_cache.one_query_attention`); other architectures (Gemma3: sliding
  windows, extra norms) take the model's forward;
* under bf16 autocast on a CPU, linear layers in decode steps run on copies of their weights that
  oneDNN packed once for single-row inputs (q/k/v and gate/up stacked): bit-identical to ``F.linear``
  under autocast and faster for one row (``benchmarks/generation.py`` measures decoding). The copies cost about the bf16
  weights' size again, made at the first bf16 generation. fp32 keeps ``F.linear`` (MKL is fast there).
  What this takes: :func:`packed_linears` replaces ``forward`` on every plain ``nn.Linear`` of the model
  (computing as before outside a packed step), and the packed copies live in module-level state
  (``_PACKED``, keyed by the modules, and a per-thread ``_DECODING.packed`` switch set by
  :func:`step_context`).
* under ``bf16-decode`` / ``f16-decode`` on a CPU, the decode steps' linear layers read bf16 / fp16 copies of their
  weights (half fp32's bytes; made at the first such generation, half the fp32 weights' size again): on x86,
  ``f16-decode`` runs fbgemm's fp16 product on fbgemm-packed copies (fp32 input and output, fp32 accumulation:
  :func:`fbgemm_f16_product`; several streams' rows at once at a fraction of ATen's 16-bit cost); otherwise the
  step's fp32 input is rounded to that dtype, ATen's product accumulates in fp32 and its output is widened back
  to fp32 (:func:`half_product`); everything between the linear layers stays fp32. Without native bf16 (AVX2)
  this is what a memory-bound step gains most from (``docs/results.md``, the AVX2 speed table).
  The marking and the LoRA rule are the int8 ones below (:func:`weight_only_linears`).
* under an int8 precision on a CPU, the decode steps' linear layers read int8 copies of their weights with one
  fp32 scale per output row, packed for fbgemm, and quantize their input to 8 bits per call (fbgemm's dynamic
  linear, :mod:`unimae.runtime.int8`; q/k/v and gate/up stacked), made at the first such generation (a quarter
  of the fp32 weights' size; with ``precision='int8'`` from the dynamically quantized layers' own int8
  weights). A LoRA adapter's own layers (unmerged) keep fp32 (:func:`weight_only_linears`). Prefill keeps the
  model's forward, so the first new token is the one the embedding precision gives. The ``_DECODING.packed``
  switch names which copies a step reads (``"bf16"``, ``"bf16w"``, ``"f16w"``, ``"f16fb"``, ``"int8"`` or None:
  :func:`decode_weights`).
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
from transformers import DynamicCache

from unimae.generation.kv_cache import KVPool, attend_rows, preallocated
from unimae.runtime.int8 import int8_product, int8_weight, prepack, quantizable_linears
from unimae.runtime.precision import HALF_DECODE_PRECISIONS, INT8_PRECISIONS, autocast, fbgemm_supported

_DECODING = threading.local()  # .packed: a decode_weights kind while this thread runs such a decode step, else None
HALF_KINDS = {"bf16-decode": "bf16w", "f16-decode": "f16w"}  # precision -> decode_weights kind
_HALF_DTYPES = {"bf16w": torch.bfloat16, "f16w": torch.float16}
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first linear of a group -> {(kind, ids): entry}
_PACK_LOCK = threading.Lock()
_LINEAR_POINTWISE = None  # torch.ops.mkldnn._linear_pointwise.default, resolved once (see packed_supported)


def packed_supported(device: torch.device) -> bool:
    """Whether this PyTorch build has oneDNN's packed bf16 linear on ``device``."""
    global _LINEAR_POINTWISE
    ok = bool(
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    if ok and _LINEAR_POINTWISE is None:
        _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
    return ok


def decode_weights(precision: str, device: torch.device) -> str | None:
    """Which weight copies the decode steps of ``precision`` read on ``device``: "bf16" (oneDNN-packed), "bf16w" /
    "f16w" (weight-only bf16 / fp16, ATen's product), "f16fb" (fp16 packed for fbgemm, fp32 activations), "int8"
    (int8, fbgemm's dynamic product), or None (the modules' own weights)."""
    if precision == "bf16" and packed_supported(device):
        return "bf16"
    if precision == "f16-decode" and fbgemm_supported(device):
        return "f16fb"
    if precision in HALF_DECODE_PRECISIONS and device.type == "cpu":
        return HALF_KINDS[precision]
    if precision in INT8_PRECISIONS and fbgemm_supported(device):
        return "int8"
    return None


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    bias = module.bias
    return bias() if callable(bias) else bias  # a dynamically quantized linear's bias is a method


def _stacked(group: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (sum out, in), bias (sum out,) or None) of ``group``'s plain linears stacked by output rows, detached,
    in their own dtype."""
    weight = torch.cat([m.weight.detach() for m in group])
    bias = torch.cat([m.bias.detach() for m in group]) if group[0].bias is not None else None
    return weight, bias


def _bf16_copy(group: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight, bias) in bf16 of ``group``'s linears stacked by output rows, packed by oneDNN for one row."""
    weight, bias = _stacked(group)
    bias = None if bias is None else bias.to(torch.bfloat16)  # (sum out,)
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), 1), bias


def _int8_copy(group: tuple[torch.nn.Module, ...]) -> tuple[torch.ScriptObject]:
    """(fbgemm-packed int8 weights and fp32 bias,) of ``group``'s linears stacked by output rows (per-row scales); a
    lone dynamically quantized layer lends its own packed weights (no copy)."""
    if len(group) == 1 and type(group[0]) is DynamicQuantizedLinear:
        return (group[0]._packed_params._packed_params,)
    parts = [int8_weight(m) for m in group]
    weight = torch.cat([p[0] for p in parts])  # (sum out, in) int8
    scales = torch.cat([p[1] for p in parts])  # (sum out,)
    bias = torch.cat([p[2] for p in parts]) if parts[0][2] is not None else None  # (sum out,)
    return (prepack(weight, scales, bias),)


def _half_copy(kind: str) -> Callable:
    """The copy function of a weight-only 16-bit kind: ``group`` -> (weight (sum out, in) in bf16 / fp16, fp32 bias
    (sum out,) or None), stacked by output rows."""

    def copy(group: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = _stacked(group)
        return weight.to(_HALF_DTYPES[kind]).contiguous(), None if bias is None else bias.float()

    return copy


def _fbgemm_f16_copy(group: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fbgemm-packed fp16 weight, fp32 bias or None) of ``group``'s linears stacked by output rows. fp16 holds
    weights up to 65504 in magnitude; a layer beyond that is an error that names bf16 (no released LLM's linear
    weights come near it, so ``auto`` does not check ahead)."""
    weight, bias = _stacked(group)
    weight = weight.float()  # (sum out, in)
    largest = weight.abs().max().item()
    if not largest <= torch.finfo(torch.float16).max:
        raise ValueError(
            f"a linear weight of {largest:g} does not fit fp16, which f16-decode (what --precision auto picks on "
            "this CPU) reads: pass --precision bf16-decode"
        )
    return torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight), None if bias is None else bias.float()


def fbgemm_f16_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x (..., K) @ weight.T + bias`` -> (..., N) in fp32, ``weight`` fbgemm-packed fp16 (:func:`_fbgemm_f16_copy`):
    ``x`` stays fp32, the weights are widened in registers and products accumulate in fp32 (fbgemm's fp16 GEMM,
    what ``quantize_dynamic(..., dtype=torch.float16)`` runs). Unlike ATen's fp16 product it neither rounds the
    input nor the output, and it multiplies several rows without widening the weights once per row. ATen calls it
    on one thread (measured: no faster with two), where its own 16-bit products use every thread."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # (M, K)
    y = torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(rows, weight, bias)  # (M, N)
    return y.view(*x.shape[:-1], -1)


def half_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x (..., K) @ weight.T + bias`` -> (..., N) in fp32, ``weight`` (N, K) read in bf16 / fp16: ``x`` is rounded to
    the weight's dtype, ATen's product accumulates in fp32 and rounds its output to that dtype, widened here."""
    y = torch.nn.functional.linear(x.to(weight.dtype), weight).float()  # (..., N)
    return y + bias if bias is not None else y


_COPIES = {
    "bf16": _bf16_copy,
    "int8": _int8_copy,
    "f16fb": _fbgemm_f16_copy,
    **{kind: _half_copy(kind) for kind in _HALF_DTYPES},
}


def _packed_group(group: tuple[torch.nn.Module, ...], kind: str = "bf16") -> tuple:
    """The ``kind`` copy of ``group``'s weights (:data:`_COPIES`: bf16 ``(packed weight, bias)``, bf16w / f16w /
    f16fb ``(weight, bias)``, int8 ``(fbgemm-packed weight and bias,)``), stacked by output rows; cached across
    generations and made again when a weight or bias changed (merge, load)."""
    params = tuple(p for m in group for p in (m.weight, m.bias) if isinstance(p, torch.Tensor))
    key = (kind, *map(id, group))

    def current() -> tuple | None:
        entry = _PACKED.get(group[0], {}).get(key)
        fresh = entry is not None and all(
            a is b and a._version == v for a, b, v in zip(params, *entry[:2], strict=True)
        )
        return entry if fresh else None

    entry = current()
    if entry is None:
        with _PACK_LOCK:
            entry = current()  # another thread may have packed it meanwhile
            if entry is None:
                entry = (params, tuple(p._version for p in params), *_COPIES[kind](group))
                _PACKED.setdefault(group[0], {})[key] = entry
    return entry[2:]


def _packed_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` under bf16 autocast (input, weight, bias cast to bf16; bf16 out), on a packed weight."""
    rows = x.to(torch.bfloat16).reshape(-1, x.shape[-1])  # (N, in)
    return _LINEAR_POINTWISE(rows, weight, bias, "none", [], "").view(*x.shape[:-1], -1)  # (..., out)


_PRODUCTS = {
    "bf16": _packed_product,
    "int8": int8_product,
    "f16fb": fbgemm_f16_product,
    **{kind: half_product for kind in _HALF_DTYPES},
}


def _reads_copy(module: torch.nn.Module, kind: str | None) -> bool:
    """Whether ``module`` computes on its ``kind`` copy: a plain ``nn.Linear`` on a packed bf16 step, a layer
    :func:`weight_only_linears` marked on a weight-only step."""
    if kind == "bf16":
        return type(module) is torch.nn.Linear
    return kind is not None and getattr(module, "_unimae_weight_only", False)


def _linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own forward, or inside a decode step of this thread, the product on its copy of the step's kind
    (:func:`_reads_copy`)."""
    kind = getattr(_DECODING, "packed", None)
    if x.device.type == "cpu" and _reads_copy(self, kind):
        return _PRODUCTS[kind](*_packed_group((self,), kind), x)
    return type(self).forward(self, x)


def _route(module: torch.nn.Module) -> None:
    if getattr(module.forward, "__func__", None) is not _linear_forward:
        module.forward = types.MethodType(_linear_forward, module)


def packed_linears(model) -> None:
    """Route every plain ``nn.Linear`` of ``model`` (LoRA's base layers and A/B included) through
    :func:`_linear_forward` (idempotent).

    Outside a bf16 decode step (embedding, training, prefill, other threads) the modules compute exactly as
    before; the packed copies (about the size of the bf16 weights) are made at the first step that needs them.
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            _route(module)


def weight_only_linears(model) -> None:
    """Mark the linear layers of ``model`` whose weights a decode precision's step (bf16w, f16w, f16fb, int8) reads
    as a copy (plain ``nn.Linear`` and dynamically quantized ones, a LoRA adapter's own layers left out:
    :func:`unimae.runtime.int8.quantizable_linears`) and route them through :func:`_linear_forward` (idempotent).
    Outside such a step they compute as before; the copies (int8: a quarter of the fp32 size, bf16 / fp16: half;
    stacked q/k/v and gate/up of dynamically quantized layers are copies too) are made at the first step."""
    names = set(quantizable_linears(model))
    for name, module in model.named_modules():
        if name in names or type(module) is DynamicQuantizedLinear:
            module._unimae_weight_only = True
            _route(module)


@contextlib.contextmanager
def step_context(precision: str, device: torch.device, packed: str | None):
    """Inference mode, autocast and the packed-linear switch (``packed``: which copies, :func:`decode_weights`) for
    one forward (entered per step, so a generator that yields between steps leaves no mode switched on in its
    consumer's code)."""
    _DECODING.packed = packed
    try:
        with torch.inference_mode(), autocast(precision, device):
            yield
    finally:
        _DECODING.packed = None


LEAN_MODEL_TYPES = ("llama", "qwen2")  # decoder layers that compute exactly Llama's one-token step (below)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x cos + rotate_half(x) sin`` in two fewer operations, bit for bit.

    ``rotate_half(x) sin = cat(-x2, x1) sin = roll(x, hd/2) cat(-sin1, sin2)`` (IEEE products are
    sign-symmetric), so with ``signed_sin`` = :func:`_signed_sin` made once per step, RoPE is one roll and
    three elementwise operations instead of two slices, a negation, a concatenation and three.
    """
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` (..., hd) with its first half negated, for :func:`_rope`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _projection(modules: list, packed: str | None):
    """A function x (..., in) -> the outputs of ``modules`` side by side (..., sum out): one product over their
    stacked copies when they all read the step's copy (:func:`_reads_copy`: plain ``nn.Linear`` on a bf16 packed
    step, marked layers on a weight-only step; q/k/v, gate/up: fewer calls, same numbers, as each output row is
    its own dot product), else each module (LoRA wrappers included) on its own, concatenated where there are
    several."""
    plain = all(type(m) is torch.nn.Linear for m in modules)
    if all(_reads_copy(m, packed) for m in modules) and len({_bias(m) is None for m in modules}) == 1:
        copy, product = _packed_group(tuple(modules), packed), _PRODUCTS[packed]
        return lambda x: product(*copy, x)
    apply = (lambda m, x: torch.nn.functional.linear(x, m.weight, m.bias)) if plain else (lambda m, x: m(x))
    if len(modules) == 1:
        return lambda x: apply(modules[0], x)
    return lambda x: torch.cat([apply(m, x) for m in modules], dim=-1)


class _LayerStep(NamedTuple):
    """What :class:`LlamaStep` calls in one decoder layer (projections as :func:`_projection` returns them)."""

    norm1: Callable  # input RMSNorm
    qkv: Callable  # x -> [q | k | v] side by side
    out: Callable  # attention output -> o
    heads: int  # query heads, H
    kv_heads: int  # key/value heads, H_kv
    head_dim: int
    scale: float
    gqa: dict  # SDPA's enable_gqa where key/value heads are shared
    norm2: Callable  # post-attention RMSNorm
    gate_up: Callable  # x -> [gate | up]
    down: Callable  # x -> down
    act: Callable


class LlamaStep:
    """The one-token forward of a Llama-family decoder (``LEAN_MODEL_TYPES``) over B independent sequences,
    as a flat loop over its layers.

    transformers' forward spends much of a 135M model's decode step outside arithmetic (module calls, mask
    and position bookkeeping, attention dispatch). This loop runs the same operations on the same
    modules, in the same order and dtypes, so at B = 1 its logits equal ``model(...)``'s bit for bit in
    fp32 (tests check token identity; a bf16 step attends in fp32, see
    :func:`~unimae.generation.kv_cache.one_query_attention`): the
    embedding, rotary, norm and activation modules and any LoRA wrapper are called as they are; plain
    ``nn.Linear`` weights are applied directly (stacked q/k/v and gate/up on a packed step); RoPE is
    ``q cos + rotate_half(q) sin`` (as :func:`_rope` computes it, on queries and keys at once) and attention
    is SDPA over the cached keys with grouped-query heads (``enable_gqa``), as transformers' ``sdpa``
    attention runs one unmasked query.

    B > 1 (in-flight batching, :mod:`unimae.serving.scheduler`): each row is its own sequence with its own
    cache of its own length, no padding. Every projection (q/k/v, o, gate/up, down, LoRA included, and the
    LM head) runs once on the stacked (B, 1, D) rows: a 135M model's step is bound by reading its weights,
    so B rows cost about what one costs. RoPE takes each row's own position. Attention: rows whose caches are
    slots of ``pool`` (:class:`~unimae.generation.kv_cache.KVPool`, ordered by slot, as :meth:`Decoder.step` passes
    them) write their keys and attend in one call per layer, each row masked to its own length; otherwise row by
    row over each row's cache. A row's logits equal its B = 1 logits up to the rounding of a B-row matrix
    product against a one-row one and of a masked attention over a longer span (tests: greedy tokens
    identical in fp32).
    """

    def __init__(self, model, packed: str | None, pooled: bool = False):
        decoder = model.get_decoder()
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.head = _projection([model.get_output_embeddings()], packed)
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _LayerStep(
                    norm1=layer.input_layernorm,
                    qkv=_projection([attn.q_proj, attn.k_proj, attn.v_proj], packed),
                    out=_projection([attn.o_proj], packed),
                    heads=attn.q_proj.out_features // attn.head_dim,
                    kv_heads=attn.k_proj.out_features // attn.head_dim,
                    head_dim=attn.head_dim,
                    scale=attn.scaling,
                    gqa={"enable_gqa": True} if attn.num_key_value_groups > 1 else {},
                    norm2=layer.post_attention_layernorm,
                    gate_up=_projection([mlp.gate_proj, mlp.up_proj], packed),
                    down=_projection([mlp.down_proj], packed),
                    act=mlp.act_fn,
                )
            )
        first, device = self.layers[0], next(model.parameters()).device
        self.pool = KVPool(len(self.layers), first.kv_heads, first.head_dim, device) if pooled else None

    @staticmethod
    def supports_model(model) -> bool:
        """True for a Llama-family model in eval mode with SDPA attention."""
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (
            not model.training
            and config.model_type in LEAN_MODEL_TYPES
            and getattr(config, "_attn_implementation", None) == "sdpa"
            and head_dim <= 256
        )

    @staticmethod
    def supports(model, cache: DynamicCache) -> bool:
        """:meth:`supports_model`, with a cache whose layers are all :class:`PreallocatedLayer`."""
        return LlamaStep.supports_model(model) and preallocated(cache)

    def __call__(self, tokens: torch.Tensor, caches: list[DynamicCache]) -> torch.Tensor:
        """tokens (B, 1), row b continuing the sequence in ``caches[b]`` -> next-token logits (B, V);
        appends each row's keys/values to its own cache."""
        rows = [cache.layers for cache in caches]
        batch = tokens.shape[0]
        pooled = batch > 1 and self.pool is not None and all(self.pool.owns(cache) for cache in caches)
        plan = self.pool.plan(caches) if pooled else None
        position = torch.tensor([[layers[0].length] for layers in rows], device=tokens.device)  # (B, 1)
        h = self.embed(tokens)  # (B, 1, D)
        cos, sin = self.rotary(h, position)  # (B, 1, hd) each
        cos, sin = cos.unsqueeze(1), _signed_sin(sin).unsqueeze(1)  # (B, 1, 1, hd): broadcast over heads
        for depth, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.norm1(h)).view(batch, 1, -1, layer.head_dim).transpose(1, 2)  # (B, H+2H_kv, 1, hd)
            qk = _rope(qkv[:, : layer.heads + layer.kv_heads], cos, sin)  # queries and keys rotated at once
            q, k, v = qk[:, : layer.heads], qk[:, layer.heads :], qkv[:, layer.heads + layer.kv_heads :]
            if plan is not None:
                a = self.pool.attend(depth, q, k, v, plan, layer.scale, layer.gqa)  # (B, H, 1, hd)
            else:
                a = attend_rows(q, k, v, [layers[depth] for layers in rows], layer.scale, layer.gqa)  # (B, H, 1, hd)
            h = h + layer.out(a.transpose(1, 2).reshape(batch, 1, -1))  # (B, 1, D)
            gate, up = layer.gate_up(layer.norm2(h)).chunk(2, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        if plan is not None:  # the pool wrote every layer's new position
            for layers in rows:
                for cache_layer in layers:
                    cache_layer.advance(1)
        return self.head(self.norm(h))[:, -1]  # (B, V)
