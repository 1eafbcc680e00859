"""The shared KV pool of the lean decode step and the batched prefill (unimae.generation.kv_cache,
Decoder.prefill_many), on tiny Llama / Qwen2 models in fp32: every row's greedy tokens equal those of the row decoded
alone."""

import gc

import pytest
import torch
from conftest import SENTENCES
from transformers import DynamicCache

from unimae.generation.decoding import Decoder, decode_tokens
from unimae.generation.kv_cache import KVPool, with_cache
from unimae.generation.sampling import GenerationParams
from unimae.models import load_model


def _model(tiny_model_dirs, arch: str = "llama"):
    model, tokenizer, _ = load_model(str(tiny_model_dirs[arch]))
    return model.float().eval(), tokenizer


def _prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts of different lengths (a sentence repeated 1, 2, ... times)."""
    return [tokenizer(" ".join([SENTENCES[i]] * (1 + i % 3)))["input_ids"] for i in range(count)]


def test_pool_gives_slots_grows_keeping_what_is_written_and_reuses_freed_slots():
    pool = KVPool(num_layers=2, kv_heads=1, head_dim=4, device=torch.device("cpu"))
    first = pool.acquire(10)
    assert (first.pool_slot, pool.slots, pool.capacity) == (0, 1, 64)
    first.layers[1].append(torch.ones(1, 1, 3, 4), torch.full((1, 1, 3, 4), 2.0))
    second = pool.acquire(100)  # no free slot and a longer generation: slots double, capacity -> 128
    assert (second.pool_slot, pool.slots, pool.capacity) == (1, 2, 128)
    keys, values = first.layers[1].keys, first.layers[1].values  # rebound to the grown storage
    assert keys.shape == (1, 1, 3, 4) and torch.equal(keys, torch.ones(1, 1, 3, 4)) and values.eq(2).all()
    assert keys.data_ptr() == pool.keys[1].data_ptr(), "slot 0 is a view of the pool"
    assert first.layers[1].capacity == 128
    pool.release(first)
    pool.release(first)  # idempotent
    assert pool.in_use() == 1 and pool.acquire(5).pool_slot == 0
    assert pool.nbytes(2, 128) == 2 * 2 * 2 * 1 * 128 * 4 * 4


def test_pool_frees_a_dropped_cache_and_refuses_beyond_its_budget():
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=4, device=torch.device("cpu"), max_bytes=4096)
    cache = pool.acquire(16)
    assert pool.in_use() == 1
    del cache
    gc.collect()
    assert pool.in_use() == 0
    assert pool.acquire(1000) is None, "64 slots' worth of memory over the budget: a cache of its own instead"


def test_an_idle_pool_shrinks_back_after_a_long_generation():
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=4, device=torch.device("cpu"))
    long = pool.acquire(3000)
    assert pool.capacity == 4096
    short = pool.acquire(10)  # the long one still runs: its slot keeps its length
    assert (pool.slots, pool.capacity) == (2, 4096)
    pool.release(long)
    pool.release(short)
    pool.acquire(10)
    assert (pool.slots, pool.capacity) == (1, 64)


def test_a_slot_takes_its_positions_as_the_generation_goes_within_the_budget():
    """A generation that may run to 300 positions starts with room for its prompt (64: the pool's least) and
    the pool doubles as it asks; the budget is still counted on its whole length. Before, every slot had room
    for 512 at once (8 SmolLM2 streams asking 256 tokens and left after one: 0.19 GB of KV pool)."""
    pool = KVPool(num_layers=2, kv_heads=1, head_dim=4, device=torch.device("cpu"))
    cache = pool.acquire(300, room=11)
    assert (pool.slots, pool.capacity, cache.layers[0].capacity) == (1, 64, 64)
    cache.layers[1].append(torch.ones(1, 1, 64, 4), torch.full((1, 1, 64, 4), 2.0))
    pool.reserve(cache, 64)
    assert pool.capacity == 64, "no growth while it fits"
    pool.reserve(cache, 65)
    assert (pool.capacity, cache.layers[1].capacity) == (128, 128)
    assert torch.equal(cache.layers[1].keys, torch.ones(1, 1, 64, 4)) and cache.layers[1].values.eq(2).all()
    assert cache.layers[1].keys.data_ptr() == pool.keys[1].data_ptr(), "rebound to the grown storage"
    with pytest.raises(RuntimeError, match="KV cache full"):
        pool.reserve(cache, 301)
    pool.max_bytes = pool.nbytes(2, 512)
    second = pool.acquire(200, room=5)
    assert second is not None, "two slots of 512 (the first one's whole length): fits"
    assert pool.acquire(10, room=5) is None, "four slots of 512 would not, though 128 are allocated"


def test_pooled_generations_that_grow_mid_decode_equal_caches_of_their_own(tiny_model_dirs):
    """Rows whose pool slot grows (64 -> 128 -> 256) while they decode give the tokens of the same rows decoded
    with caches of their own, allocated whole at the start."""
    model, tokenizer = _model(tiny_model_dirs)
    prompts, new = [ids for ids in _prompts(tokenizer, 4) if len(ids) < 63], 150  # 3 prompts: room for 64
    own = Decoder(model)
    own.pool.max_bytes = 0  # every generation gets a cache of its own
    pooled = Decoder(model)
    results = []
    for decoder in (own, pooled):
        states = [decoder.start(ids, GenerationParams(max_new_tokens=new), set()) for ids in prompts]
        got = [[t] for t in decoder.prefill_many(states)]
        owned = [decoder.pool.owns(s.cache) for s in states]
        assert owned == [decoder is pooled] * len(states) and pooled.pool.capacity in (0, 64)
        for _ in range(new - 1):
            for out, token in zip(got, decoder.step(states), strict=True):
                out.append(token)
        results.append(got)
    assert pooled.pool.capacity == 256
    assert results[0] == results[1]


def _alone(model, ids: list[int], new: int) -> list[int]:
    return list(decode_tokens(model, ids, GenerationParams(max_new_tokens=new), set()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pooled_rows_with_gaps_and_other_lengths_equal_each_decoded_alone(tiny_model_dirs, arch):
    model, tokenizer = _model(tiny_model_dirs, arch)
    prompts, new = _prompts(tokenizer, 4), 12
    expected = [_alone(model, ids, new) for ids in prompts]
    decoder = Decoder(model)
    states = [decoder.start(ids, GenerationParams(max_new_tokens=new), set()) for ids in prompts]
    assert [s.cache.pool_slot for s in states] == [0, 1, 2, 3]
    got = [[t] for t in decoder.prefill_many(states)]
    for _ in range(3):
        for out, token in zip(got, decoder.step(states), strict=True):
            out.append(token)
    states[1].close()  # slot 1 leaves: the others attend over a span with a gap
    live = [states[i] for i in (3, 0, 2)]  # any order: the step orders the rows by slot
    assert decoder.pool.plan([states[0].cache, states[2].cache, states[3].cache]).gaps
    while not live[0].finished:
        for i, token in zip((3, 0, 2), decoder.step(live), strict=True):
            got[i].append(token)
    assert [got[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    joining = decoder.start(prompts[1], GenerationParams(max_new_tokens=new), set())
    assert joining.cache.pool_slot == 1, "the freed slot is taken again"


def test_prefill_many_runs_one_forward_and_gives_each_prompts_first_token(tiny_model_dirs):
    model, tokenizer = _model(tiny_model_dirs)
    prompts = _prompts(tokenizer, 3)
    assert len({len(p) for p in prompts}) == 3
    expected = [_alone(model, ids, 6) for ids in prompts]
    decoder = Decoder(model)
    states = [decoder.start(ids, GenerationParams(max_new_tokens=6), set()) for ids in prompts]
    calls = []
    hook = model.get_decoder().register_forward_hook(  # the decoder layers run once
        lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        first = decoder.prefill_many(states)
    finally:
        hook.remove()
    assert calls == [(3, max(map(len, prompts)))], "one right-padded forward"
    assert [s.cache.get_seq_length() for s in states] == [len(p) for p in prompts]
    rest = [decoder.step(states) for _ in range(5)]
    assert [[f, *col] for f, col in zip(first, zip(*rest, strict=True), strict=True)] == expected


def test_a_generation_over_the_pools_budget_steps_beside_pooled_rows(tiny_model_dirs):
    model, tokenizer = _model(tiny_model_dirs)
    prompts = _prompts(tokenizer, 2)
    expected = [_alone(model, ids, 10) for ids in prompts] + [_alone(model, prompts[0], 300)[:10]]
    decoder = Decoder(model)
    decoder.pool.max_bytes = decoder.pool.nbytes(2, 64)  # room for two short generations only
    states = [decoder.start(ids, GenerationParams(max_new_tokens=10), set()) for ids in prompts]
    long = decoder.start(prompts[0], GenerationParams(max_new_tokens=300), set())
    assert not decoder.pool.owns(long.cache) and all(decoder.pool.owns(s.cache) for s in states)
    rows = [*states, long]
    got = [[t] for t in decoder.prefill_many(rows)]
    for _ in range(9):
        for out, token in zip(got, decoder.step(rows), strict=True):
            out.append(token)
    assert got == expected


def test_a_prefix_goes_into_a_free_slot_after_the_pool_grew_mid_decode(tiny_model_dirs):
    """A pool grown by a decode step (inference mode) keeps normal tensors: a later generation that continues a
    prefix cache (RAG's KV reuse) is copied into a free slot outside inference mode, which an inference tensor
    refuses."""
    model, tokenizer = _model(tiny_model_dirs)
    decoder = Decoder(model)
    ids = tokenizer(SENTENCES[0])["input_ids"]
    long, done = (decoder.start(ids, GenerationParams(max_new_tokens=150), set()) for _ in range(2))
    decoder.prefill_many([long, done])
    done.close()  # slot 1 is free again
    for _ in range(100):  # the pool grows 64 -> 128 positions inside a step
        decoder.step([long])
    assert (decoder.pool.slots, decoder.pool.capacity) == (2, 128)
    assert not decoder.pool.keys[0].is_inference()
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **with_cache(prefix))
    state = decoder.start([*ids, 5, 6], GenerationParams(max_new_tokens=4), set(), past_key_values=prefix)
    assert decoder.pool.owns(state.cache) and state.cache.get_seq_length() == len(ids)
    assert decoder.prefill(state) == _alone(model, [*ids, 5, 6], 1)[0]
