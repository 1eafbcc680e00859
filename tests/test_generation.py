"""The token loop (unimae.generation.decoding) against ``model.generate``, and the options around it, on tiny models.

Greedy output must be token-identical to ``model.generate(do_sample=False)`` in fp32 on every
architecture, with and without an unmerged LoRA adapter, with and without a prefix KV cache.
"""

import math
import threading

import numpy as np
import pytest
import torch
from conftest import SENTENCES

from unimae import tiny_models
from unimae.encoder import Encoder
from unimae.generation.decoding import Decoder, DecodeState, decode_tokens, eos_token_ids
from unimae.generation.fast_path import LlamaStep, packed_supported
from unimae.generation.kv_cache import PreallocatedLayer, start_cache
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult, generate_stream, generate_text
from unimae.models import load_model

PROMPTS = ["the cat sat on", SENTENCES[2] + " and the"]
NEW = 40  # more than gemma3's sliding window (8): its sliding layers wrap around


def _load(tiny_dir, lora: bool, dtype=torch.float32):
    model, tokenizer, _ = load_model(str(tiny_dir))
    model = model.to(dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    return model, tokenizer


def _reference(model, tokenizer, ids: list[int], new: int = NEW, precision: str = "fp32") -> list[int]:
    """Greedy ids from ``model.generate`` (what generation ran before the token loop)."""
    x = torch.tensor([ids])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.inference_mode(), autocast:
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


def _fast(model, tokenizer, ids: list[int], new: int = NEW, precision: str = "fp32", **kwargs) -> list[int]:
    eos = eos_token_ids(model, tokenizer)
    return list(decode_tokens(model, ids, GenerationParams(max_new_tokens=new), eos, precision, **kwargs))


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_greedy_is_token_identical_to_generate_in_fp32(tiny_dir, lora):
    model, tokenizer = _load(tiny_dir, lora)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected = _reference(model, tokenizer, ids)
        assert _fast(model, tokenizer, ids) == expected, prompt
        result = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=NEW))
        assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert result.completion_tokens == len(expected) and result.prompt_tokens == len(ids)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_prefix_cache_gives_the_same_tokens_and_is_not_modified(tiny_dir, lora):
    model, tokenizer = _load(tiny_dir, lora)
    ids = tokenizer(PROMPTS[1])["input_ids"]
    expected = _reference(model, tokenizer, ids)
    for keep in (3, len(ids) - 1, len(ids)):  # a prefix, all but one, the whole prompt (one token re-fed)
        with torch.inference_mode():
            prefix = model.get_decoder()(input_ids=torch.tensor([ids[:keep]]), use_cache=True).past_key_values
        before = [(layer.keys.clone(), layer.values.clone()) for layer in prefix.layers]
        assert _fast(model, tokenizer, ids, past_key_values=prefix) == expected, keep
        result = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=NEW), past_key_values=prefix)
        # a whole-prompt cache is cut by one position; gemma3's full sliding layers cannot be: no reuse
        sliding = any(layer.is_sliding for layer in prefix.layers)
        assert result.cached_tokens == (keep if keep < len(ids) else 0 if sliding else len(ids) - 1)
        assert prefix.get_seq_length() == keep
        assert all(
            torch.equal(k, layer.keys) and torch.equal(v, layer.values)
            for (k, v), layer in zip(before, prefix.layers, strict=True)
        )


def test_llama_family_takes_the_lean_step(tiny_model_dirs):
    for arch, lean in (("llama", True), ("qwen2", True), ("gemma3", False)):
        model, _ = _load(tiny_model_dirs[arch], lora=False)
        assert LlamaStep.supports(model, start_cache(model, 16)) is lean, arch


@pytest.fixture
def one_query_attention_in_fp32():
    """The model's own SDPA attention computing one-query steps in fp32, as unimae's decode step does."""
    with tiny_models.one_query_attention_in_fp32():
        yield


@pytest.mark.skipif(not packed_supported(torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_bf16_packed_step_matches_generate(tiny_dir, lora, one_query_attention_in_fp32):
    """bf16 weights under autocast: the packed oneDNN products equal F.linear's, so tokens match ``generate``'s
    once its one-query attention runs in fp32 too."""
    model, tokenizer = _load(tiny_dir, lora, dtype=torch.bfloat16)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        assert _fast(model, tokenizer, ids, precision="bf16") == _reference(model, tokenizer, ids, precision="bf16")


def test_preallocated_layer_crop_rewinds_the_write_position():
    layer = PreallocatedLayer(capacity=6)
    k, v = torch.arange(4.0).view(1, 1, 4, 1), -torch.arange(4.0).view(1, 1, 4, 1)  # (B, H_kv, T, D)
    layer.update(k, v)
    layer.crop(-2)
    assert layer.get_seq_length() == 2 and layer.keys.shape[2] == 2
    keys, values = layer.update(torch.full((1, 1, 1, 1), 9.0), torch.full((1, 1, 1, 1), -9.0))
    assert keys.flatten().tolist() == [0.0, 1.0, 9.0] and values.flatten().tolist() == [0.0, -1.0, -9.0]
    layer.reset()
    assert layer.get_seq_length() == 0
    with pytest.raises(NotImplementedError, match="fixed batch"):
        layer.batch_select_indices(torch.tensor([0]))


def test_preallocated_layer_stores_fp32_and_gives_the_model_its_own_dtype():
    layer = PreallocatedLayer(capacity=4, dtype=torch.float32)
    k = torch.tensor([1.0078125, -3.5]).view(1, 1, 2, 1).bfloat16()  # (B, H_kv, T, D), exact in bf16
    keys, values = layer.update(k, -k)  # the model's own attention (prefill): its dtype back
    assert keys.dtype == values.dtype == torch.bfloat16 and torch.equal(keys, k)
    keys, values = layer.append(k[:, :, :1], -k[:, :, :1])  # the lean step: the stored fp32, no cast
    assert keys.dtype == values.dtype == torch.float32
    assert keys.flatten().tolist() == [1.0078125, -3.5, 1.0078125] and torch.equal(values, -keys)


def test_only_the_lean_decoder_stores_the_cache_in_fp32(tiny_model_dirs):
    for arch, kv_dtype in (("llama", torch.float32), ("gemma3", None)):
        model, _ = _load(tiny_model_dirs[arch], lora=False, dtype=torch.bfloat16)
        decoder = Decoder(model, "bf16")
        assert decoder.kv_dtype == kv_dtype, arch
        state = DecodeState.start(model, [1, 2, 3], GenerationParams(max_new_tokens=2), set(), None, decoder.kv_dtype)
        decoder.prefill(state)
        decoder.step([state])
        stored = {layer.keys.dtype for layer in state.cache.layers}
        assert stored == {kv_dtype or torch.bfloat16}, arch


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_frozen_head_gets_a_contiguous_row_in_the_prefill(tiny_model_dirs, arch):
    """hidden[:, -1:] is a strided view; with a weight that needs no grad, matmul would copy the whole head."""
    from torch.profiler import profile

    model, _ = _load(tiny_model_dirs[arch], lora=False)
    model.requires_grad_(False)  # as a merged adapter loads
    decoder = Decoder(model)
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    state = decoder.start(list(range(1, 12)), GenerationParams(max_new_tokens=1), set())
    with profile(record_shapes=True) as prof:
        decoder.prefill(state)
    assert seen == [True]
    vocab = model.get_output_embeddings().weight.shape[0]
    head = [e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm") and vocab in sum(e.input_shapes, [])]
    assert head == ["aten::mm"]  # one matrix product, not a batched one over a copy of the weight
    Decoder(model)
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 2  # ours once (idempotent) + the test's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rope_equals_transformers_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from unimae.generation.fast_path import _rope, _signed_sin

    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 1, 16, dtype=dtype), torch.randn(2, 2, 1, 16, dtype=dtype)  # (B, H or H_kv, 1, hd)
    angles = torch.randn(2, 1, 8)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes cos/sin at dim 1
    rotated = _rope(torch.cat((q, k), dim=1), cos.unsqueeze(1), _signed_sin(sin).unsqueeze(1))
    assert torch.equal(rotated[:, :6], q_ref) and torch.equal(rotated[:, 6:], k_ref)


def test_bf16_one_query_attention_runs_in_fp32_under_autocast():
    from unimae.generation.kv_cache import one_query_attention

    torch.manual_seed(0)
    q = torch.randn(1, 6, 1, 16).bfloat16()  # (1, H, 1, hd)
    keys, values = torch.randn(1, 2, 40, 16).bfloat16(), torch.randn(1, 2, 40, 16).bfloat16()  # (1, H_kv, T, hd)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float(), values.float(), scale=0.25, enable_gqa=True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = one_query_attention(q, keys, values, 0.25, {"enable_gqa": True})
        in_bf16 = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=0.25, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.bfloat16())
    assert (out.float() - exact).abs().max() <= (in_bf16.float() - exact).abs().max()


@pytest.mark.skipif(not packed_supported(torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_warm_up_packs_the_decode_weights_before_the_first_request(tiny_model_dirs):
    from unimae.generation import fast_path
    from unimae.generation.decoding import warm_up

    model, tokenizer = _load(tiny_model_dirs["llama"], lora=False, dtype=torch.bfloat16)
    warm_up(model, "fp32")
    assert model.lm_head not in fast_path._PACKED
    warm_up(model, "bf16")
    assert model.lm_head in fast_path._PACKED and model.model.layers[0].mlp.gate_proj in fast_path._PACKED


@pytest.mark.skipif(not packed_supported(torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_the_server_state_warms_up_a_bf16_model(tiny_model_dirs):
    from unimae.generation import fast_path
    from unimae.serving.config import ServerConfig
    from unimae.serving.state import ServerState

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="bf16", max_length=16)
    ServerState.build(encoder, ServerConfig(model_name="tiny"))
    assert encoder.model.get_output_embeddings() in fast_path._PACKED


def test_generation_leaves_embeddings_and_modes_alone(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    enc = Encoder(model, tokenizer, precision="bf16" if packed_supported(torch.device("cpu")) else "fp32", device="cpu")
    before = enc.encode(SENTENCES[:4])
    items = []
    for item in generate_stream(model, tokenizer, enc.prompt_ids("the cat"), GenerationParams(8), enc.precision):
        assert not torch.is_inference_mode_enabled() and not torch.is_autocast_enabled("cpu")
        items.append(item)
    np.testing.assert_array_equal(enc.encode(SENTENCES[:4]), before)
    assert isinstance(items[-1], GenerationResult)


def test_stop_string_cuts_text_and_is_never_streamed(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    ids = tokenizer("the river")["input_ids"]
    full = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=24))
    assert full.finish_reason == "length" and len(full.text) > 6
    stop = full.text[3:6]
    items = list(generate_stream(model, tokenizer, ids, GenerationParams(max_new_tokens=24, stop=[stop])))
    pieces, result = items[:-1], items[-1]
    assert result.text == full.text[: full.text.find(stop)] == "".join(pieces)
    assert result.finish_reason == "stop" and result.completion_tokens < full.completion_tokens
    assert all(stop not in piece for piece in pieces)


def test_eos_ends_the_generation(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["qwen2"]))
    ids = tokenizer("the cat")["input_ids"]
    first = _fast(model, tokenizer, ids, new=3)
    model.generation_config.eos_token_id = first[1]  # the second greedy token now ends the generation
    result = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=10))
    assert result.completion_tokens == 2 and result.finish_reason == "stop"
    going_on = generate_text(model, tokenizer, ids, GenerationParams(max_new_tokens=10, ignore_eos=True))
    assert going_on.completion_tokens == 10 and going_on.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_keeps_the_global_rng(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["gemma3"]))
    ids = tokenizer("the cat")["input_ids"]
    state = torch.random.get_rng_state()
    params = [GenerationParams(max_new_tokens=16, temperature=1.5, top_p=p, seed=s) for p in (1.0, 0.9) for s in (1, 2)]
    texts = [[generate_text(model, tokenizer, ids, p).text for _ in range(2)] for p in params]
    assert all(a == b for a, b in texts), "same seed, same text"
    assert len({a for a, _ in texts}) > 1, "other seeds sample other texts"
    assert torch.equal(torch.random.get_rng_state(), state)


def test_top_p_keeps_only_the_nucleus(tiny_model_dirs):
    from unimae.generation.sampling import pick_token

    logits = torch.tensor([[5.0, 4.9, -3.0, -4.0]])  # softmax ~ [0.52, 0.47, 0.0002, 0.00006]
    generator = torch.Generator().manual_seed(0)
    params = GenerationParams(temperature=1.0, top_p=0.9)
    assert {pick_token(logits, params, generator) for _ in range(300)} == {0, 1}
    assert pick_token(logits, GenerationParams(), None) == 0
    # a tiny temperature (the schema allows any value in [0, 2]) overflowed the scores to inf -> NaN probabilities
    tiny = GenerationParams(temperature=1e-38, top_p=0.9)
    assert pick_token(torch.tensor([[30.0, 10.0, -5.0, 2.0]]), tiny, generator) == 0


def test_cancel_stops_within_a_token(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    ids = tokenizer("the cat")["input_ids"]
    cancel = threading.Event()
    tokens = decode_tokens(model, ids, GenerationParams(max_new_tokens=50), set(), cancel=cancel)
    next(tokens), next(tokens)
    cancel.set()
    assert list(tokens) == []
    cancel = threading.Event()
    result = None
    for item in generate_stream(model, tokenizer, ids, GenerationParams(max_new_tokens=50), cancel=cancel):
        cancel.set()  # the consumer (e.g. a server whose client left) cancels at the first piece
        result = item
    assert isinstance(result, GenerationResult) and result.finish_reason == "stop"
    assert result.completion_tokens < 50


def test_closing_the_stream_ends_the_generation(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    stream = generate_stream(model, tokenizer, tokenizer("the cat")["input_ids"], GenerationParams(max_new_tokens=50))
    next(stream)
    stream.close()
    assert next(stream, None) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"seed": -1}, "seed must be in"),
    ],
)
def test_bad_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationParams(**kwargs)


def test_empty_prompt_is_rejected(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_text(model, tokenizer, [], GenerationParams())
    with pytest.raises(ValueError, match="prompt is empty"):  # the token source alone says so too
        next(decode_tokens(model, [], GenerationParams(), set()))
