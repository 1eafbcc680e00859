"""The token loop behind every generation: prefill once, then one forward per new token, no ``generate``.

A 135M model reads its weights once per token, so on a CPU the cost around that arithmetic decides the
speed. ``model.generate`` adds a logits-processor and stopping-criteria stack, a streamer queue and a
worker thread, and its ``DynamicCache`` copies the whole KV cache (``torch.cat``) at every step;
transformers' forward adds module calls, mask and position bookkeeping and attention dispatch around
each layer. :func:`decode_tokens` keeps what a step needs:

* prefill with the model's own forward (LoRA merged or not, as loaded), logits for the last position only;
* a KV cache preallocated for the prompt and ``max_new_tokens`` (:class:`PreallocatedLayer`): a step
  writes one position and attends over a view;
* for Llama-family models (:data:`LEAN_MODEL_TYPES`) the one-token steps run :class:`LlamaStep`, a flat
  loop over the layers with the same operations on the same modules (bit-identical logits in fp32; a bf16
  step attends in fp32, about 5x faster than PyTorch's bf16 SDPA for one query on a CPU); other
  architectures (Gemma3: sliding windows, extra norms) take the model's forward;
* a step can advance B independent generations at once (:class:`Decoder`, :class:`DecodeState`), each
  with its own cache: the server's in-flight batching (:mod:`unimae.serving.scheduler`) runs the
  projections once over the B rows and attention row by row (see :class:`LlamaStep`);
* under bf16 autocast on a CPU, linear layers in decode steps run on copies of their weights that
  oneDNN packed once for single-row inputs (q/k/v and gate/up stacked): bit-identical to ``F.linear``
  under autocast and about twice as fast for one row (SmolLM2 shapes). The copies cost about the bf16
  weights' size again, made at the first bf16 generation. fp32 keeps ``F.linear`` (MKL is fast there).

Greedy output is token-identical to ``model.generate(do_sample=False)`` (tests/test_generation.py, fp32
on Llama, Gemma3 and Qwen2, with and without LoRA and a prefix cache; in bf16 where oneDNN runs it, against
``generate`` with its one-query attention in fp32 too). The next token is picked by
:func:`~unimae.generation.sampling.pick_token` (greedy, or a seeded temperature / top-p draw).
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from unimae.generation.kv_cache import KVPool, attend_rows, preallocated, reusable_prefix, start_cache, with_cache
from unimae.generation.sampling import GenerationParams, pick_token
from unimae.runtime.precision import autocast

_DECODING = threading.local()  # .packed: this thread runs a bf16 decode step (see packed_linears)
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first nn.Linear of a group -> {ids: entry}
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


def _packed_group(group: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(packed weight, bias) in bf16 of ``group``'s linears stacked by output rows, packed by oneDNN for
    one-row inputs; cached across generations and made again when a weight or bias changed (merge, load)."""
    params = tuple(p for m in group for p in (m.weight, m.bias) if p is not None)
    key = tuple(map(id, group))

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
                weight = torch.cat([m.weight.detach() for m in group]).to(torch.bfloat16)  # (sum out, in)
                bias = None
                if group[0].bias is not None:
                    bias = torch.cat([m.bias.detach() for m in group]).to(torch.bfloat16)  # (sum out,)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                entry = (params, tuple(p._version for p in params), packed, bias)
                _PACKED.setdefault(group[0], {})[key] = entry
    return entry[2], entry[3]


def _packed_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` under bf16 autocast (input, weight, bias cast to bf16; bf16 out), on a packed weight."""
    rows = x.to(torch.bfloat16).reshape(-1, x.shape[-1])  # (N, in)
    return _LINEAR_POINTWISE(rows, weight, bias, "none", [], "").view(*x.shape[:-1], -1)  # (..., out)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, or inside a bf16 decode step of this thread, the product on the packed weight."""
    if getattr(_DECODING, "packed", False) and x.device.type == "cpu":
        return _packed_product(*_packed_group((self,)), x)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _contiguous_input(module, args):
    x = args[0]
    dense = 1
    for size, stride in reversed(list(zip(x.shape, x.stride(), strict=True))):
        if stride != dense:  # is_contiguous() ignores the strides of size-1 dims; matmul's folding does not
            return (x.clone(memory_format=torch.contiguous_format), *args[1:])
        dense *= size
    return args


def contiguous_head_input(model) -> None:
    """Hand the output head a contiguous input (a forward pre-hook; idempotent).

    A prefill keeps only the last position's logits (``logits_to_keep=1``), so the head gets
    ``hidden[:, -1:]``, a (1, 1, D) view with a batch stride of T x D. When the head's weight does not require
    grad (a merged adapter, or any frozen model), ``torch.matmul`` will not fold such a view into a matrix
    product: it multiplies by a batched copy of the transposed weight, copying the whole head at every
    prefill (Gemma-3-270M's 262k x 640: 0.6 s of a 1.0 s prefill of 438 tokens, measured; SmolLM2's 49k x 576
    head likewise). ``contiguous()`` does not help: a (1, 1, D) view already counts as contiguous. Copying the
    one row into fresh strides first costs a few microseconds.
    """
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_unimae_contiguous_input", False):
        head.register_forward_pre_hook(_contiguous_input)
        head._unimae_contiguous_input = True


def packed_linears(model) -> None:
    """Route every plain ``nn.Linear`` of ``model`` (LoRA's base layers and A/B included) through
    :func:`_linear_forward` (idempotent).

    Outside a bf16 decode step (embedding, training, prefill, other threads) the modules compute exactly as
    before; the packed copies (about the size of the bf16 weights) are made at the first step that needs them.
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear and getattr(module.forward, "__func__", None) is not _linear_forward:
            module.forward = types.MethodType(_linear_forward, module)


@contextlib.contextmanager
def _step_context(precision: str, device: torch.device, packed: bool):
    """Inference mode, autocast and the packed-linear switch for one forward (entered per step, so a
    generator that yields between steps leaves no mode switched on in its consumer's code)."""
    _DECODING.packed = packed
    try:
        with torch.inference_mode(), autocast(precision, device):
            yield
    finally:
        _DECODING.packed = False


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


def _projection(modules: list, packed: bool):
    """A function x (..., in) -> the outputs of ``modules`` side by side (..., sum out): one packed product over
    their stacked weights when they are all plain ``nn.Linear`` on a packed step (q/k/v, gate/up: fewer oneDNN
    calls, same numbers, as each output row is its own dot product), else each module (LoRA wrappers
    included) on its own, concatenated where there are several."""
    plain = all(type(m) is torch.nn.Linear for m in modules)
    if packed and plain and len({m.bias is None for m in modules}) == 1:
        weight, bias = _packed_group(tuple(modules))
        return lambda x: _packed_product(weight, bias, x)
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

    def __init__(self, model, packed: bool, pooled: bool = False):
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


def eos_token_ids(model, tokenizer) -> set[int]:
    """Token ids that end a generation: the model's generation config's (as ``generate``) and the tokenizer's."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list | tuple) else [source])
    return ids


@dataclass(eq=False)
class DecodeState:
    """One generation in progress: its own KV cache and sampler, the ids it feeds next, how far it got.

    ``feed`` is (1, T): the uncached prompt tail until the prefill, then the last new token (1, 1).
    ``finished``: the last token was an EOS id, or ``params.max_new_tokens`` tokens were produced.
    """

    params: GenerationParams
    eos_ids: set[int]
    cache: DynamicCache
    generator: torch.Generator | None
    feed: torch.Tensor
    produced: int = 0
    finished: bool = False

    @classmethod
    def start(
        cls,
        model,
        input_ids: list[int],
        params: GenerationParams,
        eos_ids: set[int],
        past_key_values=None,
        kv_dtype: torch.dtype | None = None,
        pool: KVPool | None = None,
    ):
        """The state before the prefill: a cache for the prompt and ``max_new_tokens`` with the reusable part
        of ``past_key_values`` copied in (not modified; see :func:`reusable_prefix`), a seeded sampler.
        ``kv_dtype``: what the cache stores (:attr:`Decoder.kv_dtype`; default: the model's keys' dtype);
        ``pool``: where the cache goes if it has room (:attr:`Decoder.pool`)."""
        if not input_ids:
            raise ValueError("the prompt is empty: generation needs at least one token (e.g. BOS)")
        device = next(model.parameters()).device
        cached = reusable_prefix(past_key_values, len(input_ids))
        capacity = len(input_ids) + params.max_new_tokens
        cache = start_cache(model, capacity, past_key_values, cached, kv_dtype, pool)
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=device)
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        return cls(params, eos_ids, cache, generator, torch.tensor([input_ids[cached:]], device=device))

    def take(self, logits: torch.Tensor) -> int:
        """Pick the next token from this sequence's last-position ``logits`` (1, V) and feed it next."""
        token = pick_token(logits, self.params, self.generator)
        self.produced += 1
        self.finished = token in self.eos_ids or self.produced >= self.params.max_new_tokens
        self.feed = torch.tensor([[token]], device=self.feed.device)  # (1, 1)
        return token

    def close(self) -> None:
        """Give the cache's pool slot back (idempotent); the state must not be stepped after this."""
        release = getattr(self.cache, "pool_release", None)
        if release is not None:
            release()
        self.finished = True


class Decoder:
    """The forwards of a model's generations: a prefill for one :class:`DecodeState`, then one-token steps
    over any number of them at once.

    A step runs :class:`LlamaStep` over every state whose cache it supports (Llama-family models), and the
    model's own forward, state by state, over the others (Gemma3: sliding windows and extra norms; correct
    but not faster than one generation after another). Built once per generation by :func:`decode_tokens`,
    once per server by the scheduler: its packed bf16 weights are taken at construction, so the model's
    weights must not change while it is in use.
    """

    def __init__(self, model, precision: str = "fp32"):
        self.model, self.precision = model, precision
        self.device = next(model.parameters()).device
        self.packed = precision == "bf16" and packed_supported(self.device)
        if self.packed:
            packed_linears(model)
        contiguous_head_input(model)
        self.pool = self.lean = None
        if LlamaStep.supports_model(model):  # a pool only where every layer attends over all positions
            full = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
            self.lean = LlamaStep(model, self.packed, pooled=full)
            self.pool = self.lean.pool
        self.kv_dtype = torch.float32 if self.lean is not None else None  # the lean step attends in fp32

    def start(self, input_ids: list[int], params: GenerationParams, eos_ids: set[int], past_key_values=None):
        """:meth:`DecodeState.start` for this decoder's model, its cache stored as the steps read it
        (:attr:`kv_dtype`)."""
        return DecodeState.start(self.model, input_ids, params, eos_ids, past_key_values, self.kv_dtype, self.pool)

    def prefill(self, state: DecodeState) -> int:
        """Feed the state's prompt tail with the model's own forward -> the first new token."""
        with _step_context(self.precision, self.device, False):
            return state.take(self._forward(state))

    def prefill_many(self, states: list[DecodeState], budget: int | None = None) -> list[int]:
        """:meth:`prefill` for several states -> their first tokens, in as few forwards as it can.

        Pooled states with nothing cached go through the model's own forward together, right-padded to the
        longest prompt (at most ``budget`` padded tokens a forward, default :data:`PREFILL_TOKENS`), their
        keys/values then copied
        into their slots: eight 106-token SmolLM2 prompts take about 0.6 s this way against 0.9 s one by one
        (bf16, 2 cores), compute-bound work that a bigger matrix product does better. The others (a prefix
        cache to continue, a cache of its own) are prefilled one by one. A row's first token equals the one
        its own prefill gives up to the rounding of a bigger matrix product (tests: identical in fp32).
        """
        with _step_context(self.precision, self.device, False):
            logits: dict[int, torch.Tensor] = {}
            group = [i for i, s in enumerate(states) if self._joins_padded_prefill(s)]
            for chunk in padded_groups([states[i].feed.shape[1] for i in group], budget or PREFILL_TOKENS):
                rows = [group[j] for j in chunk]
                if len(rows) > 1:
                    logits.update(zip(rows, self._padded_forward([states[i] for i in rows]), strict=True))
            return [s.take(logits[i] if i in logits else self._forward(s)) for i, s in enumerate(states)]

    def _joins_padded_prefill(self, state: DecodeState) -> bool:
        return self.pool is not None and self.pool.owns(state.cache) and state.cache.get_seq_length() == 0

    def _padded_forward(self, states: list[DecodeState]) -> list[torch.Tensor]:
        """One forward over ``states``' prompts, right-padded -> each one's last-position logits (1, V); each
        state's keys/values (its own positions only) copied into its cache."""
        lengths = [s.feed.shape[1] for s in states]
        ids = torch.zeros(len(states), max(lengths), dtype=torch.long, device=self.device)  # (B, T) pad id 0
        mask = torch.zeros_like(ids)  # (B, T) 1 = a prompt token
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            ids[row, :n], mask[row, :n] = state.feed[0], 1
        cache = DynamicCache(config=self.model.config)
        hidden = self.model.get_decoder()(
            input_ids=ids, attention_mask=mask, **with_cache(cache)
        ).last_hidden_state  # (B, T, D)
        last = hidden[torch.arange(len(states)), torch.tensor(lengths) - 1]  # (B, D) each row's last prompt token
        logits = self.model.get_output_embeddings()(last[:, None])[:, 0]  # (B, V): the head on B rows only
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            for layer, source in zip(state.cache.layers, cache.layers, strict=True):
                layer.append(source.keys[row : row + 1, :, :n], source.values[row : row + 1, :, :n])
        return [logits[row : row + 1] for row in range(len(states))]

    def step(self, states: list[DecodeState]) -> list[int]:
        """One new token for each of ``states`` (prefilled, not finished), in one forward where it can."""
        with _step_context(self.precision, self.device, self.packed):
            logits: list[torch.Tensor | None] = [None] * len(states)
            lean = [i for i, s in enumerate(states) if self.lean is not None and preallocated(s.cache)]
            lean.sort(key=lambda i: getattr(states[i].cache, "pool_slot", None) or 0)  # pooled rows in slot order
            if lean:
                tokens = torch.cat([states[i].feed for i in lean]) if len(lean) > 1 else states[lean[0]].feed  # (B, 1)
                batch = self.lean(tokens, [states[i].cache for i in lean])  # (B, V)
                for row, i in enumerate(lean):
                    logits[i] = batch[row : row + 1]  # (1, V)
            return [s.take(x if x is not None else self._forward(s)) for s, x in zip(states, logits, strict=True)]

    def _forward(self, state: DecodeState) -> torch.Tensor:
        """The model's own forward of ``state.feed`` -> last-position logits (1, V)."""
        out = self.model(input_ids=state.feed, logits_to_keep=1, **with_cache(state.cache))
        return out.logits[:, -1]


PREFILL_TOKENS = 2048  # padded tokens in one batched prefill forward (Decoder.prefill_many)


def padded_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups, longest first, whose padded size (count x longest) fits ``budget``
    (a longer one alone)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode_tokens(
    model,
    input_ids: list[int],
    params: GenerationParams,
    eos_ids: set[int],
    precision: str = "fp32",
    past_key_values=None,
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """Yield the new token ids after ``input_ids``, one per forward, until an EOS id (yielded too),
    ``params.max_new_tokens`` or ``cancel``.

    ``past_key_values``: the KV cache of a prefix of ``input_ids`` (not modified); only the rest is
    prefilled (see :func:`reusable_prefix`). The first token comes after the prefill, each next one after
    a single-token step.
    """
    decoder = Decoder(model, precision)
    state = decoder.start(input_ids, params, eos_ids, past_key_values)
    try:
        while not state.finished:
            if cancel is not None and cancel.is_set():
                return
            yield decoder.prefill(state) if state.produced == 0 else decoder.step([state])[0]
    finally:
        state.close()


def warm_up(model, precision: str) -> None:
    """Make what the first generation would make (oneDNN-packed bf16 weights, about the bf16 weights' size,
    0.1-1 s for a 135M model), so the first request does not pay for it; ``ServerState.build`` calls it.
    A no-op in fp32."""
    if precision == "bf16" and packed_supported(next(model.parameters()).device):
        for _ in decode_tokens(model, [0], GenerationParams(max_new_tokens=2), set(), precision):
            pass
