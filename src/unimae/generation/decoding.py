"""The token loop behind every generation: prefill once, then one forward per new token, no ``generate``.

A 135M model reads its weights once per token, so on a CPU the cost around that arithmetic decides the
speed. ``model.generate`` adds a logits-processor and stopping-criteria stack, a streamer queue and a
worker thread, and its ``DynamicCache`` copies the whole KV cache (``torch.cat``) at every step;
transformers' forward adds module calls, mask and position bookkeeping and attention dispatch around
each layer. :func:`decode_tokens` keeps what a step needs:

* prefill with the model's own forward (LoRA merged or not, as loaded), logits for the last position only;
* a KV cache preallocated for the prompt and ``max_new_tokens`` (:class:`PreallocatedLayer`; a slot of a
  :class:`KVPool` grows to them as the generation goes): a step writes one position and attends over a view;
* one-token steps on the CPU fast path of :mod:`unimae.generation.fast_path` where it applies (its
  :class:`LlamaStep` for Llama-family models, oneDNN-packed bf16 weights, int8 weights under the int8
  precisions), the model's forward otherwise;
* a step can advance B independent generations at once (:class:`Decoder`, :class:`DecodeState`), each
  with its own cache: the server's in-flight batching (:mod:`unimae.serving.scheduler`) runs the
  projections once over the B rows and attention row by row (see :class:`LlamaStep`).

Greedy output is token-identical to ``model.generate(do_sample=False)`` (tests/test_generation.py, fp32
on Llama, Gemma3 and Qwen2, with and without LoRA and a prefix cache; in bf16 where oneDNN runs it, against
``generate`` with its one-query attention in fp32 too). The 16-bit decode and int8 precisions round the decode steps'
weights, so their tokens follow fp32's only as far as the rounding leaves the argmax alone
(tests/test_inference_precisions.py). The next token is picked by
:func:`~unimae.generation.sampling.pick_token` (greedy, or a seeded temperature / top-p draw).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from unimae.generation.fast_path import LlamaStep, decode_weights, packed_linears, step_context, weight_only_linears
from unimae.generation.kv_cache import KVPool, preallocated, reusable_prefix, start_cache, with_cache
from unimae.generation.sampling import GenerationParams, pick_token


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
        ``pool``: where the cache goes if it has room (:attr:`Decoder.pool`), with room for the prompt and its
        first new token; :meth:`Decoder.step` reserves each next position."""
        if not input_ids:
            raise ValueError("the prompt is empty: generation needs at least one token (e.g. BOS)")
        device = next(model.parameters()).device
        cached = reusable_prefix(past_key_values, len(input_ids))
        capacity = len(input_ids) + params.max_new_tokens
        cache = start_cache(model, capacity, past_key_values, cached, kv_dtype, pool, room=len(input_ids) + 1)
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
    once per server by the scheduler: its packed bf16 or weight-only (16-bit, int8) copies are taken at
    construction, so the model's weights must not change while it is in use.
    """

    def __init__(self, model, precision: str = "fp32"):
        self.model, self.precision = model, precision
        self.device = next(model.parameters()).device
        self.packed = decode_weights(precision, self.device)  # "bf16", "bf16w", "f16w", "f16fb", "int8" or None
        if self.packed == "bf16":
            packed_linears(model)
        elif self.packed is not None:
            weight_only_linears(model)
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
        with step_context(self.precision, self.device, None):
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
        with step_context(self.precision, self.device, None):
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
        rows = torch.arange(len(states), device=hidden.device)  # (B,)
        last = hidden[rows, torch.tensor(lengths, device=hidden.device) - 1]  # (B, D) each row's last prompt token
        logits = self.model.get_output_embeddings()(last[:, None])[:, 0]  # (B, V): the head on B rows only
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            for layer, source in zip(state.cache.layers, cache.layers, strict=True):
                layer.append(source.keys[row : row + 1, :, :n], source.values[row : row + 1, :, :n])
        return [logits[row : row + 1] for row in range(len(states))]

    def step(self, states: list[DecodeState]) -> list[int]:
        """One new token for each of ``states`` (prefilled, not finished), in one forward where it can."""
        with step_context(self.precision, self.device, self.packed):
            for state in states:  # a pool slot takes its positions as the generation goes
                if self.pool is not None and self.pool.owns(state.cache):
                    self.pool.reserve(state.cache, state.cache.get_seq_length() + 1)
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


def forced_logits(model, precision: str, input_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits (len(tokens), V) in fp32 of the next token at each position: ``input_ids`` prefilled, then ``tokens``
    fed one at a time through the decode steps whatever the model would pick (teacher forcing), so a precision's
    decode steps can be compared with fp32's on the same text."""
    decoder = Decoder(model, precision)
    state = decoder.start(input_ids, GenerationParams(max_new_tokens=len(tokens)), set())
    seen: list[torch.Tensor] = []

    def take(logits: torch.Tensor) -> int:  # records the logits and feeds the forced token
        seen.append(logits[0].float().clone())
        state.feed = torch.tensor([[tokens[len(seen) - 1]]])
        return tokens[len(seen) - 1]

    state.take = take
    try:
        decoder.prefill(state)
        while len(seen) < len(tokens):
            decoder.step([state])
    finally:
        state.close()
    return torch.stack(seen)  # (N, V)


def warm_up(model, precision: str) -> None:
    """Make what the first generation would make (oneDNN-packed bf16 weights, about the bf16 weights' size,
    0.1-1 s for a 135M model; 16-bit or int8 copies of fp32 weights), so the first request does not pay for it;
    ``ServerState.build`` calls it. A no-op in fp32."""
    if decode_weights(precision, next(model.parameters()).device) is not None:
        for _ in decode_tokens(model, [0], GenerationParams(max_new_tokens=2), set(), precision):
            pass
