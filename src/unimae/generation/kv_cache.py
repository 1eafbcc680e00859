"""The KV caches of generations, and the attention of a one-token decode step over them.

* :class:`PreallocatedLayer`: a full-attention cache layer with room for a whole generation (prompt and
  ``max_new_tokens``): a step writes one position in place and attends over a view, where transformers'
  ``DynamicCache`` concatenates the whole cache at every step.
* :class:`KVPool`: the storage of many generations side by side, one slot each, so that a step over B rows
  writes their new keys with one indexed copy per layer and attends over all of them in one call
  (:meth:`KVPool.attend`) instead of a copy, an attention call and a concatenation per row and layer
  (:func:`attend_rows`, still used for one row and for rows that are not in a pool).
* :func:`start_cache`: a generation's cache, from a pool or on its own, with the reusable part of a prefix
  cache (e.g. a RAG query's embedding pass, :func:`reusable_prefix`) copied in.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

# The forward keyword (and output field) of a KV cache: ``cache`` from transformers 5.2x on, where
# ``past_key_values`` still works with a FutureWarning until its removal in 5.40; ``past_key_values`` before.
CACHE = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def with_cache(cache) -> dict:
    """The keyword arguments that hand ``cache`` to a transformers forward: ``model(ids, **with_cache(cache))``."""
    return {CACHE: cache, "use_cache": True}


def returned_cache(output):
    """The KV cache a transformers forward returned (``output.cache`` or, before 5.2x, ``past_key_values``)."""
    return getattr(output, CACHE)


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV-cache layer with room for ``capacity`` positions, allocated at first use.

    ``update`` (transformers' interface) copies the new keys/values in place and returns the filled part,
    shaped ``(B, H_kv, T, D)`` as a ``DynamicLayer`` returns it, in the new keys' dtype, so the model's own
    attention sees the tensors it would see. ``dtype``: the dtype the cache stores (default: the first keys'
    own). :class:`~unimae.generation.fast_path.LlamaStep` stores a bf16 model's cache in fp32 and reads it with
    :meth:`append` (no cast): its attention runs in fp32 (see :func:`one_query_attention`), and casting the
    whole cache up at every step and layer was a measurable part of a decode step (``benchmarks/generation.py``
    measures decoding; docs/results.md, "Speed on a quiet machine", has the timing). Storing
    fp32 copies of bf16 values is exact, so the numbers are those of a bf16 cache; the memory is twice as much.
    A layer of a :class:`KVPool` stores into the pool's tensors (:meth:`bind`) instead of its own.
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.store_dtype = dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.store_dtype or key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self._keys = key_states.new_empty(batch, heads, self.capacity, dim, dtype=self.dtype)  # (B, H_kv, capacity, D)
        self._values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1], dtype=self.dtype)
        self.is_initialized = True

    # ``keys`` / ``values``: views of the written part, made when read (a pooled step advances every layer of
    # every row without reading them). transformers' constructor sets them to None; nothing else may set them.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys[:, :, : self.length] if self.is_initialized else None  # (B, H_kv, T, D)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("a PreallocatedLayer's keys are a view of its storage; use append or crop")

    @property
    def values(self) -> torch.Tensor | None:
        return self._values[:, :, : self.length] if self.is_initialized else None  # (B, H_kv, T, D)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("a PreallocatedLayer's values are a view of its storage; use append or crop")

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store into ``keys`` / ``values`` ``(1, H_kv, capacity, D)`` (a pool's slot) from now on; the positions
        written so far must already be there (the pool copies them when it grows)."""
        self._keys, self._values = keys, values
        self.capacity, self.dtype, self.device = keys.shape[2], keys.dtype, keys.device
        self.is_initialized = True

    def advance(self, positions: int) -> None:
        """Count ``positions`` more as written (a :class:`KVPool` step writes them into the pool directly)."""
        self.length += positions

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the new keys/values in place -> views of the filled part ``(B, H_kv, T, D)`` in the stored dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.advance(end - self.length)
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.append(key_states, value_states)
        return keys.to(key_states.dtype), values.to(value_states.dtype)  # views where the dtypes agree

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (transformers' convention: a negative count);
        the next ``update`` writes after what is left."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.crop(-self.length)

    def _fixed_batch(self, *args, **kwargs):
        raise NotImplementedError("a PreallocatedLayer holds one generation's fixed batch; use a DynamicCache")

    batch_select_indices = batch_repeat_interleave = reorder_cache = _fixed_batch


def preallocated(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is a :class:`PreallocatedLayer` (what the lean decode step needs)."""
    return all(type(layer) is PreallocatedLayer for layer in cache.layers)


@dataclass
class StepPlan:
    """Where B pooled rows of one decode step write and read (the same for every layer), rows ordered by slot.

    ``slots`` / ``positions`` (B,): each row's slot and the position its new key goes to; ``lo``..``hi``: the
    slots the attention call spans (slots in between that are not in the step are ``gaps``: a dummy query that
    sees position 0 only, output dropped); ``rows`` (B,): each row's index in that span; ``length``: keys read
    (the longest row's, new key included); ``mask`` (hi - lo, 1, 1, length) bool, or None when every row sees
    every key read.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    lo: int
    hi: int
    rows: torch.Tensor
    gaps: bool
    length: int
    mask: torch.Tensor | None


class KVPool:
    """The caches of the generations one decoder advances together, in shared tensors: per layer one keys and
    one values tensor ``(slots, H_kv, capacity, D)`` in ``dtype``; a generation's cache is a slot, its
    :class:`PreallocatedLayer` s bound to ``[slot : slot + 1]`` views.

    Why: with a cache per row, an 8-row SmolLM2 step made 240 attention calls (30 layers x 8 rows) and as
    many appends, slices and concatenations; pooled, a layer writes the rows' new keys with one indexed copy
    and attends over them in one call. ``benchmarks/generation.py`` measures the 8-stream rate this serves;
    docs/results.md ("Speed on a quiet machine") has the step timings.

    Growth: a slot for each generation (slots double when none is free), the capacity of the longest one so far
    rounded up to a power of two (at least 64); growing copies what is written and rebinds the live caches,
    layer by layer, so a step never sees it happen and the old and new storage of only one layer coexist. A
    generation takes its positions as it goes: it comes with room for its prompt (:meth:`acquire`'s ``room``)
    and the decoder asks for each next position (:meth:`reserve`), not with its whole ``max_tokens`` at once,
    since every slot has the pool's capacity: one stream that asks for 256 tokens and is left after its first
    (a client that goes) made 8 slots of SmolLM2 512 positions long, 0.19 GB, where 64 do. An idle pool more
    than twice as long as the next generation needs starts over small, so one long generation does not leave
    every later slot that long. A generation whose whole length (prompt and ``max_new_tokens``), in every slot,
    would take the pool beyond ``max_bytes`` gets a cache of its own (:meth:`acquire` returns None); the step
    then attends row by row. So growth on demand never passes ``max_bytes``: it stops at the longest whole
    length of the generations in the pool, which that check counted.
    Slots are given back by :meth:`release` (a cache's ``pool_release``, also run when the cache is collected).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        max_bytes: int = 1 << 30,
    ):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.device, self.dtype, self.max_bytes = device, dtype, max_bytes
        self.keys: list[torch.Tensor] = []  # per layer (slots, H_kv, capacity, D)
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0
        self._free: list[int] = []
        self._owners: dict[int, tuple[object, weakref.ref, int]] = {}  # slot -> (ticket, its cache, capacity)
        self._lock = threading.Lock()

    def nbytes(self, slots: int, capacity: int) -> int:
        """The pool's memory with ``slots`` slots of ``capacity`` positions."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * slots * self.kv_heads * capacity * self.head_dim * itemsize

    def acquire(self, capacity: int, room: int | None = None) -> DynamicCache | None:
        """A cache for a generation of at most ``capacity`` positions in a free slot, with room for ``room`` of them
        now (default: all; more with :meth:`reserve`), or None if ``capacity`` positions in every slot would take
        the pool beyond ``max_bytes``. The pool grows if needed."""
        room = capacity if room is None else min(room, capacity)
        with self._lock:
            if not self._owners and room < self.capacity // 2:  # idle and too big: start small again
                self.keys, self.values, self._free = [], [], []
                self.slots = self.capacity = 0
            slots = self.slots if self._free else max(1, 2 * self.slots)
            longest = max([capacity, *(most for _, _, most in self._owners.values())])
            if self.nbytes(slots, max(self.capacity, _rounded(longest))) > self.max_bytes:
                return None
            length = max(self.capacity, _rounded(room))
            if (slots, length) != (self.slots, self.capacity):
                self._grow(slots, length)
            slot = min(self._free)
            self._free.remove(slot)
            cache = DynamicCache()
            cache.layers = [PreallocatedLayer(length, self.dtype) for _ in range(self.num_layers)]
            for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
                layer.bind(keys[slot : slot + 1], values[slot : slot + 1])
            ticket = object()
            self._owners[slot] = (ticket, weakref.ref(cache), capacity)
            cache.pool_slot = slot
            cache.pool_release = weakref.finalize(cache, self._release, slot, ticket)
            return cache

    def reserve(self, cache: DynamicCache, positions: int) -> None:
        """Room for ``positions`` in ``cache``'s slot (at most the ``capacity`` it was acquired with): the pool's
        capacity doubles until it has it (every slot: the live caches are rebound)."""
        if positions <= self.capacity:
            return
        with self._lock:
            _, _, most = self._owners[cache.pool_slot]
            if positions > most:
                raise RuntimeError(f"KV cache full: {positions} positions > capacity {most}")
            if positions > self.capacity:
                self._grow(self.slots, _rounded(positions))

    def release(self, cache: DynamicCache) -> None:
        """Give ``cache``'s slot back (idempotent; a no-op for a cache that is not in a pool)."""
        release = getattr(cache, "pool_release", None)
        if release is not None:
            release()

    def _release(self, slot: int, ticket: object) -> None:
        with self._lock:
            owner = self._owners.get(slot)
            if owner is not None and owner[0] is ticket:
                del self._owners[slot]
                self._free.append(slot)

    def in_use(self) -> int:
        """How many slots hold a generation."""
        return len(self._owners)

    def _grow(self, slots: int, capacity: int) -> None:
        """New tensors of ``slots`` x ``capacity``, what is written copied over, the live caches rebound: layer by
        layer, so that each layer's old storage is freed before the next layer's new one is made. The new tensors are
        normal ones even when a decode step (inference mode) grows the pool: a free slot that a prefix cache is
        later copied into outside inference mode (:func:`start_cache`) must take the write."""
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        live = [(slot, ref()) for slot, (_, ref, _) in self._owners.items()]
        for layer in range(self.num_layers):
            for store in (self.keys, self.values):
                with torch.inference_mode(False):
                    # zeros, not empty: a masked key's value still meets a 0 weight, and 0 x NaN garbage is NaN
                    fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    if layer < len(store):
                        fresh[: self.slots, :, : self.capacity].copy_(store[layer])
                store[layer : layer + 1] = [fresh]
            keys, values = self.keys[layer], self.values[layer]
            for slot, cache in live:
                if cache is not None:
                    cache.layers[layer].bind(keys[slot : slot + 1], values[slot : slot + 1])
        self._free += range(self.slots, slots)
        self.slots, self.capacity = slots, capacity

    def owns(self, cache: DynamicCache) -> bool:
        """Whether ``cache`` is a live slot of this pool."""
        slot = getattr(cache, "pool_slot", None)
        owner = self._owners.get(slot) if slot is not None else None
        return owner is not None and owner[1]() is cache

    def plan(self, caches: list[DynamicCache]) -> StepPlan:
        """The :class:`StepPlan` of one step over ``caches`` (this pool's, ordered by slot)."""
        slots = [cache.pool_slot for cache in caches]
        lengths = [cache.layers[0].length for cache in caches]
        lo, hi = slots[0], slots[-1] + 1
        length = max(lengths) + 1
        gaps = hi - lo != len(slots)
        mask = None
        if gaps or min(lengths) != max(lengths):
            seen = [1] * (hi - lo)  # keys each slot of the span sees: a gap slot position 0 only
            for slot, n in zip(slots, lengths, strict=True):
                seen[slot - lo] = n + 1
            mask = torch.arange(length)[None, :] < torch.tensor(seen)[:, None]  # (hi - lo, length)
            mask = mask[:, None, None, :].to(self.device)  # (hi - lo, 1, 1, length)
        device = self.device
        as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
        return StepPlan(
            as_tensor(slots), as_tensor(lengths), lo, hi, as_tensor([s - lo for s in slots]), gaps, length, mask
        )

    def attend(
        self, depth: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, scale: float, gqa: dict
    ) -> torch.Tensor:
        """Layer ``depth`` of a step over the rows of ``plan``: write their new keys/values into their slots, then
        each row's query over its own keys in one call.

        q (B, H, 1, hd), k / v (B, H_kv, 1, hd) -> (B, H, 1, hd) in q's dtype, computed in fp32 as
        :func:`one_query_attention` computes one row (positions beyond a row's length are masked out).
        The caches' lengths are not advanced here: the step does that once all layers are written.
        """
        keys, values = self.keys[depth], self.values[depth]
        keys[plan.slots, :, plan.positions] = k[:, :, 0].to(keys.dtype)  # (B, H_kv, hd) into each row's slot
        values[plan.slots, :, plan.positions] = v[:, :, 0].to(values.dtype)
        span_keys = keys[plan.lo : plan.hi, :, : plan.length]  # (hi - lo, H_kv, T, hd), a view
        span_values = values[plan.lo : plan.hi, :, : plan.length]
        query = q.float()
        if plan.gaps:
            query = query.new_zeros(plan.hi - plan.lo, *query.shape[1:]).index_copy_(0, plan.rows, query)
        with torch.autocast(q.device.type, enabled=False):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, span_keys, span_values, attn_mask=plan.mask, dropout_p=0.0, scale=scale, **gqa
            )  # (hi - lo, H, 1, hd)
        if plan.gaps:
            out = out.index_select(0, plan.rows)
        return out.to(q.dtype)


def _rounded(positions: int) -> int:
    """A pool's capacity for ``positions``: the next power of two, at least 64."""
    return max(64, 1 << (positions - 1).bit_length())


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list, scale: float, gqa: dict
) -> torch.Tensor:
    """Each row's query over its own cache layer, after appending its new key/value there.

    q (B, H, 1, hd), k / v (B, H_kv, 1, hd) -> (B, H, 1, hd) in q's dtype; row b attends over ``caches[b]``
    only. A bf16 step attends in fp32 (:func:`one_query_attention`) over a cache stored in fp32 (see
    :class:`PreallocatedLayer`).
    """
    parts = []
    for row, cache in enumerate(caches):
        keys, values = cache.append(k[row : row + 1], v[row : row + 1])  # (1, H_kv, T_row, hd), stored dtype
        parts.append(one_query_attention(q[row : row + 1], keys, values, scale, gqa))  # (1, H, 1, hd)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, gqa: dict):
    """softmax(q K^T * scale) V for one new position: q (1, H, 1, hd), keys / values (1, H_kv, T, hd) ->
    (1, H, 1, hd) in q's dtype.

    Half-precision inputs are computed in fp32, autocast off: PyTorch 2.13's CPU SDPA takes several times
    longer in bf16 than in fp32 for one query (SmolLM2 shapes; timings in docs/results.md, "Speed on a quiet
    machine"), which made attention a large part of an 8-row decode step (``benchmarks/generation.py``). fp32
    is also the more exact of the two, so a bf16 step's logits differ from the model's own bf16 forward by
    rounding only (the prefill, embeddings and Gemma3's steps keep the model's attention).
    """
    dtype = q.dtype  # bf16 on bf16 weights; fp32 weights under autocast give fp32 q, k (RoPE) and bf16 v
    q, keys, values = q.float(), keys.float(), values.float()  # no copy for what is fp32 already
    with torch.autocast(q.device.type, enabled=False):  # autocast would cast SDPA's inputs back down
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False, **gqa
        )  # (1, H, 1, hd)
    return out.to(dtype)


def reusable_prefix(past_key_values, prompt_length: int) -> int:
    """How many positions of a prefix cache a prompt of ``prompt_length`` tokens reuses.

    At most ``prompt_length - 1``: the last prompt token is always fed, as its logits give the first new
    token. A cache covering the whole prompt is cut by one position, which a sliding-window layer that
    already dropped its oldest positions cannot undo: such a cache is not reused (0).
    """
    if past_key_values is None:
        return 0
    length = past_key_values.get_seq_length()
    keep = min(length, prompt_length - 1)
    if keep < length and any(
        getattr(layer, "is_sliding", False) and layer.get_seq_length() >= layer.get_max_length()
        for layer in past_key_values.layers
    ):
        return 0
    return keep


def start_cache(
    model,
    capacity: int,
    prefix=None,
    keep: int = 0,
    dtype: torch.dtype | None = None,
    pool: KVPool | None = None,
    room: int | None = None,
) -> DynamicCache:
    """A fresh cache for one generation of at most ``capacity`` positions.

    From ``pool`` where it has room (every layer full attention: the decoder checks), with ``room`` positions
    now and more as the generation asks (:meth:`KVPool.reserve`); else full-attention
    layers become :class:`PreallocatedLayer` s of their own and sliding-window (and any other) layers stay as
    the model's config makes them. With ``prefix`` (a cache of the prompt's first tokens, e.g. the query's
    embedding pass) and ``keep`` > 0 (see :func:`reusable_prefix`), its first ``keep`` positions are copied
    in; ``prefix`` itself is not modified. ``dtype``: what the full-attention layers store (see
    :class:`PreallocatedLayer`; default: the model's keys' dtype).
    """
    cache = pool.acquire(capacity, room) if pool is not None else None
    if cache is not None:
        if prefix is not None and keep:
            for layer, source in zip(cache.layers, prefix.layers, strict=True):
                layer.append(source.keys[:, :, :keep], source.values[:, :, :keep])
        return cache
    if prefix is None or keep == 0:
        cache = DynamicCache(config=model.config)
        cache.layers = [
            PreallocatedLayer(capacity, dtype) if type(lay) is DynamicLayer else lay for lay in cache.layers
        ]
        return cache
    cache = DynamicCache()
    cache.layers = []
    drop = prefix.get_seq_length() - keep
    for layer in prefix.layers:
        if type(layer) in (DynamicLayer, PreallocatedLayer) and layer.is_initialized:
            fresh = PreallocatedLayer(capacity, dtype)
            fresh.append(layer.keys[:, :, :keep], layer.values[:, :, :keep])
        else:
            fresh = copy.deepcopy(layer)
            if drop:
                fresh.crop(-drop)
        cache.layers.append(fresh)
    return cache
