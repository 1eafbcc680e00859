"""Write a base model with its adapter merged as ONE GGUF file that llama.cpp serves for both jobs.

Weights: the float32 merge of :func:`unimae.adapter.merged_model`; each tensor is renamed to llama.cpp's
name (``gguf.TensorNameMap``), put in the layout llama.cpp expects (Llama's q/k rows are permuted from
Hugging Face's half-rotation order to llama.cpp's interleaved rotary order, as llama.cpp's own
``convert_hf_to_gguf.py`` does) and stored as ``f32``, ``f16``, ``bf16`` or ``q8_0`` (``gguf.quants``).
1-D tensors (norms, biases) stay float32 and a 2-D tensor whose rows are not whole 32-blocks falls
back from q8_0 to f16, both as in llama.cpp's converter.

Metadata: copied from the base model's own GGUF when it came from one (offline short name, a ``.gguf``
path, or a cache folder made from one), so the tokenizer, its pre-tokenizer and the chat template are
exactly the original's; otherwise built from the Hugging Face config and fast tokenizer (byte-level BPE
only). Added on top: ``{arch}.pooling_type = last`` and ``unimae.*`` keys stating the embedding rule.

The EOS rule. unimae embeds with the last-layer state at an EOS appended **after** truncation. llama.cpp
pools the last token of whatever it is given, and appends EOS only if ``tokenizer.ggml.add_eos_token``
is set, which would also append it to every generation prompt and break completions. So the file keeps
``add_eos_token`` as the base has it and the **client** appends EOS: either the token text
(``unimae.embedding.eos_token``, e.g. ``<|im_end|>``; llama.cpp parses special tokens in embedding
inputs) or, when texts may be long, token ids truncated to ``max_length - 1`` plus
``unimae.embedding.eos_token_id``. ``unimae serve --engine llama.cpp`` does the latter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unimae.adapter import adapter_revision, merged_model
from unimae.embedding.spec import EmbeddingSpec
from unimae.files import atomic_write, check_writable, read_json
from unimae.models import MANIFEST, OFFLINE_MODELS, load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
KEY_PREFIX = "unimae."


@dataclass(frozen=True)
class ArchRule:
    """How a Hugging Face ``model_type`` maps to a llama.cpp architecture."""

    gguf_arch: str
    permute_qk: bool  # llama.cpp's LLAMA graph uses interleaved rotary pairs; HF stores half-rotation order
    norm_shift: float = 0.0  # added to every RMSNorm weight: Gemma's norms scale by (1 + w), llama.cpp's by w


ARCHITECTURES: dict[str, ArchRule] = {
    "llama": ArchRule("llama", permute_qk=True),
    "qwen2": ArchRule("qwen2", permute_qk=False),
    "gemma3_text": ArchRule("gemma3", permute_qk=False, norm_shift=1.0),
}

# Hugging Face pre-tokenizers (tokenizer.json, ``pre_tokenizer``) and the llama.cpp pre-tokenizer type that
# splits text the same way, as llama.cpp's converter pairs them. Keyed by structure, not by model name.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: list[tuple[list[dict], str]] = [
    ([_BYTE_LEVEL], "gpt-2"),
    ([{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL], "smollm"),
    (
        [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
        ],
        "qwen2",
    ),
]
# llama.cpp applies no normalizer; NFC changes nothing on text that is already NFC (nearly all text).
_NORMALIZERS = (None, {"type": "NFC"})


def file_types() -> dict:
    """{type name: (GGML tensor type, llama.cpp file type)} of the types this exporter writes."""
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F

    return {
        "f32": (Q.F32, F.ALL_F32),
        "f16": (Q.F16, F.MOSTLY_F16),
        "bf16": (Q.BF16, F.MOSTLY_BF16),
        "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
    }


def source_gguf(model: str) -> Path | None:
    """The GGUF file ``model`` was loaded from (offline name, .gguf path, or a cache folder made from one)."""
    if model in OFFLINE_MODELS:
        return OFFLINE_MODELS[model].locate()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if (path / MANIFEST).is_file():
        source = read_json(path / MANIFEST, "model cache manifest").get("source")
        if source and Path(source).is_file():
            return Path(source)
    return None


def arch_rule(config) -> ArchRule:
    """The llama.cpp architecture for a transformers config; ValueError for one this exporter does not map."""
    if config.model_type not in ARCHITECTURES:
        raise ValueError(
            f"GGUF export supports model types {sorted(ARCHITECTURES)}, not {config.model_type!r}; "
            "export --format hf and convert with llama.cpp's convert_hf_to_gguf.py (then append EOS yourself)"
        )
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"GGUF export does not write rope scaling {rope!r}; export --format hf instead")
    return ARCHITECTURES[config.model_type]


def check_expressible(config, tokenizer, source: Path | None) -> ArchRule:
    """The llama.cpp architecture of ``config``; ValueError for what a GGUF of it cannot say that is known
    without its weights: the model type and rope scaling (:func:`arch_rule`), a ``source`` GGUF (whose metadata
    is copied) of another architecture, and without one a Gemma 3 config llama.cpp's graph cannot run
    (:func:`check_gemma3_expressible`) or a tokenizer with no llama.cpp pre-tokenizer."""
    from gguf import GGUFReader

    rule = arch_rule(config)
    if source is not None:
        found = _field(GGUFReader(source), "general.architecture")
        if found != rule.gguf_arch:
            raise ValueError(f"{source} is a {found!r} GGUF, not {rule.gguf_arch!r}")
        return rule
    if rule.gguf_arch == "gemma3":
        check_gemma3_expressible(config)
    llama_cpp_pre_tokenizer(tokenizer)
    return rule


def base_config(model: str):
    """The transformers config of ``model``, read without its weights; None when it cannot be read here
    (offline, a damaged cache): loading the model then reports that, as it always has."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model_path(model))
    except OSError:
        return None


def check_before_merge(model: str) -> Path | None:
    """Refuse, in seconds, a ``model`` whose GGUF export :func:`write_gguf` would refuse after the float32
    merge: :func:`check_expressible` on its config and tokenizer, and a llama.cpp name for every weight (from a
    weightless copy of the model). Returns its source GGUF (see :func:`source_gguf`)."""
    import torch
    from transformers import AutoModelForCausalLM

    source, config = source_gguf(model), base_config(model)
    if config is None:
        return source
    rule = check_expressible(config, load_tokenizer(resolve_model_path(model)), source)
    with torch.device("meta"):  # parameter names only: no memory, no weights read
        skeleton = AutoModelForCausalLM.from_config(config)
    list(_gguf_names(config, rule, skeleton.state_dict()))  # raises for a weight llama.cpp cannot name
    return source


def write_gguf(
    merged,
    tokenizer,
    output: str | Path,
    out_type: str = "f16",
    spec: EmbeddingSpec | None = None,
    source: Path | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    """Write the (merged, float32) causal LM ``merged`` and its tokenizer to ``output`` as a GGUF file.

    ``source``: the base model's GGUF, whose metadata is copied; None builds it from config + tokenizer.
    ``extra``: more string keys under ``unimae.`` (base model, adapter revision).
    """
    from gguf import GGUFReader, GGUFWriter, PoolingType

    spec = spec or EmbeddingSpec()
    if not spec.is_last_token:
        raise ValueError(f"a GGUF model pools the last token; this adapter embeds with {spec.describe()}")
    if out_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {out_type!r}; choose one of {GGUF_TYPES}")
    rule = check_expressible(merged.config, tokenizer, source)
    qtype, file_type = file_types()[out_type]
    reader = GGUFReader(source) if source is not None else None
    tensors = list(_tensors(merged, rule, qtype))

    def write(tmp: Path) -> None:
        writer = GGUFWriter(tmp, rule.gguf_arch)
        if reader is not None:
            _copy_metadata(reader, writer)
        else:
            _config_metadata(writer, merged.config, rule)
            _tokenizer_metadata(writer, tokenizer, merged.config.vocab_size)
        writer.add_file_type(int(file_type))
        if out_type == "q8_0":
            writer.add_quantization_version(2)
        writer.add_pooling_type(PoolingType.LAST)
        finish_gguf(writer, unimae_keys(tokenizer, spec, extra or {}), tensors)

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out, write)


def finish_gguf(writer, keys: list[tuple], tensors) -> None:
    """Add ``keys`` ((key, value, type) triples) and ``tensors`` ((name, array, raw type)) to ``writer``,
    write the file and close it: the last steps of every GGUF unimae writes (model and LoRA adapter)."""
    for key, value, vtype in keys:
        writer.add_key_value(key, value, vtype)
    for name, array, raw_type in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def unimae_keys(tokenizer, spec: EmbeddingSpec, extra: dict[str, str]) -> list[tuple]:
    """(key, value, GGUF type) of the ``unimae.*`` keys: the embedding rule, and ``extra`` as strings."""
    from gguf import GGUFValueType

    text = GGUFValueType.STRING
    rule = (
        "append the EOS token after truncation; the embedding is the last-layer state at that EOS "
        "(llama.cpp pooling 'last'). Send text.strip() + eos_token (special tokens are parsed) or token ids."
    )
    keys = [
        ("embedding.attention", spec.attention, text),
        ("embedding.pooling", spec.pooling, text),
        ("embedding.eos_token", tokenizer.eos_token, text),
        ("embedding.eos_token_id", int(tokenizer.eos_token_id), GGUFValueType.UINT32),
        ("embedding.rule", rule, text),
        # prompts: prepend the text of unimae.embedding.prompt.query to a retrieval query (".document" to passages)
        *((f"embedding.prompt.{name}", prompt, text) for name, prompt in spec.prompts),
        *(  # a rotation is not carried: llama.cpp's vectors are h_eos, whose raw prefixes were not fitted
            (("embedding.matryoshka_dims", ",".join(map(str, spec.matryoshka_dims)), text),)
            if spec.matryoshka_dims and not spec.rotation
            else ()
        ),
        *((name, str(value), text) for name, value in extra.items()),
    ]
    return [(KEY_PREFIX + name, value, vtype) for name, value, vtype in keys]


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


_NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version")


def _copy_metadata(reader, writer) -> None:
    """Every key of the base GGUF but those that describe its own tensors (file type) or that we set."""
    from gguf import GGUFValueType

    for field in reader.fields.values():
        name = field.name
        if name.startswith(("GGUF.", KEY_PREFIX)) or name in _NOT_COPIED or name.endswith(".pooling_type"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)


def _config_metadata(writer, config, rule: ArchRule) -> None:
    """Architecture hyperparameters from a transformers config (Llama / Qwen2 family, Gemma 3)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rule.gguf_arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_name(getattr(config, "_name_or_path", "") or config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _rope_theta(config) -> float:
    """The rotary base (of the full-attention layers where layer types have their own, as Gemma 3's)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters, per layer type where they differ
        parameters = getattr(config, "rope_parameters", None) or {}
        theta = parameters.get("full_attention", parameters).get("rope_theta", 10000.0)
    return float(theta)


def check_gemma3_expressible(config) -> None:
    """ValueError unless llama.cpp's gemma3 graph computes what this Gemma 3 config does. llama.cpp fixes
    what the file cannot say: every 6th layer global and the others sliding-window, rotary base 10,000 on
    the sliding layers without scaling, queries scaled by 1/sqrt(head_dim), no logit soft-capping."""
    layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]
    rope = getattr(config, "rope_parameters", None) or {}
    head_dim = config.head_dim
    problems = {
        "layer_types other than every 6th layer global": list(getattr(config, "layer_types", layers)) != layers,
        "a sliding-layer rotary base other than 10000 or rotary scaling": any(
            (rope.get(kind) or {}).get("rope_type", "default") != "default"
            for kind in ("sliding_attention", "full_attention")
        )
        or float((rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)) != 10000.0,
        f"query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim {head_dim}": config.query_pre_attn_scalar
        != head_dim,
        "logit soft-capping": bool(config.final_logit_softcapping or config.attn_logit_softcapping),
    }
    found = [name for name, bad in problems.items() if bad]
    if found:
        raise ValueError(
            f"llama.cpp's gemma3 graph cannot express this Gemma 3 config ({'; '.join(found)}); export --format hf"
        )


def llama_cpp_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a Hugging Face byte-level BPE tokenizer (ValueError if unknown)."""
    import json

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    if data["model"]["type"] != "BPE" or data.get("normalizer") not in _NORMALIZERS:
        raise ValueError(
            "GGUF export from a Hugging Face folder needs a byte-level BPE tokenizer without a normalizer; "
            "export from the model's .gguf file (--model FILE.gguf) so its tokenizer is copied"
        )
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for pattern, name in _PRE_TOKENIZERS:
        if len(steps) == len(pattern) and all(_matches(s, p) for s, p in zip(steps, pattern, strict=True)):
            return name
    raise ValueError(
        f"no llama.cpp pre-tokenizer is known to split text like {pre}; export from the model's .gguf file "
        "(--model FILE.gguf) so its tokenizer metadata is copied"
    )


def _matches(step: dict, pattern: dict) -> bool:
    return all(step.get(key) == value for key, value in pattern.items())


def _tokenizer_metadata(writer, tokenizer, vocab_size: int) -> None:
    """A llama.cpp 'gpt2' (byte-level BPE) tokenizer from a Hugging Face fast tokenizer."""
    import json

    from gguf import TokenType

    pre = llama_cpp_pre_tokenizer(tokenizer)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i >= vocab_size:
            raise ValueError(f"token {token!r} has id {i}, beyond the model's vocab_size {vocab_size}")
        tokens[i], types[i] = token, TokenType.NORMAL
    for i, added in tokenizer.added_tokens_decoder.items():
        types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    for name, token_id in (
        ("bos", tokenizer.bos_token_id),
        ("eos", tokenizer.eos_token_id),
        ("unk", tokenizer.unk_token_id),
        ("pad", tokenizer.pad_token_id),
    ):
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and with_special[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(False)  # generation prompts must not end in EOS; embedding clients append it
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)


def _permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head * head_dim, ...) rows from HF's half-rotation order to llama.cpp's interleaved pairs."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tensor_name_map(config, rule: ArchRule):
    """``gguf.TensorNameMap`` of the llama.cpp architecture: Hugging Face parameter name -> GGUF tensor name."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == rule.gguf_arch)
    return get_tensor_name_map(arch, config.num_hidden_layers)


def gguf_tensor_name(names, hf_name: str, config) -> str:
    """llama.cpp's name for the Hugging Face parameter ``hf_name`` (ValueError if it has none)."""
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"no llama.cpp tensor name for {hf_name!r} ({config.model_type}); export --format hf")
    return name


def llama_cpp_rows(hf_name: str, array: np.ndarray, config, rule: ArchRule) -> np.ndarray:
    """``array``, whose rows are the output rows of parameter ``hf_name``, in llama.cpp's row order
    (q/k rows permuted to interleaved rotary pairs where the architecture needs it; else unchanged)."""
    if rule.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute_rotary(array, config.num_attention_heads)
    if rule.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute_rotary(array, config.num_key_value_heads)
    return array


def _gguf_names(config, rule: ArchRule, hf_names) -> Iterator[tuple[str, str]]:
    """(transformers name, GGUF name) of each weight a GGUF stores, in order: a tied output head is not stored
    (llama.cpp reuses the token embedding); ValueError for a weight llama.cpp has no name for."""
    names = tensor_name_map(config, rule)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name in hf_names:
        if not (tied and hf_name == "lm_head.weight"):
            yield hf_name, gguf_tensor_name(names, hf_name, config)


def _tensors(merged, rule: ArchRule, qtype) -> Iterator[tuple[str, np.ndarray, object]]:
    """(GGUF name, array, GGML type) per weight, in the model's order."""
    config, state = merged.config, merged.state_dict()
    for hf_name, name in _gguf_names(config, rule, state):
        tensor = state[hf_name]
        array = llama_cpp_rows(hf_name, tensor.detach().float().cpu().numpy(), config, rule)
        if rule.norm_shift and hf_name.endswith("norm.weight"):
            array = array + np.float32(rule.norm_shift)
        yield (name, *encode_tensor(array, qtype))


def encode_tensor(array: np.ndarray, qtype):
    """(stored array, GGML type): 1-D stays f32; q8_0 needs rows of whole 32-blocks, else f16."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if array.ndim == 1 or qtype == Q.F32:
        return np.ascontiguousarray(array, dtype=np.float32), Q.F32
    if qtype == Q.Q8_0 and array.shape[-1] % 32 != 0:
        qtype = Q.F16
    return quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), qtype


def export_gguf(model: str, adapter: str | None, out: Path, spec: EmbeddingSpec, gguf_type: str) -> Path:
    """Write ``model`` with ``adapter`` merged to the new file ``out`` (``.gguf``) as ``gguf_type``; return its path.
    Before minutes of merging, not after: the type, the output file and its folder, and what the GGUF cannot
    express (:func:`check_before_merge`)."""
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose one of {GGUF_TYPES}")
    if out.suffix != ".gguf":
        raise ValueError(f"--output {out} must be a file name ending in .gguf for --format gguf")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new --output file")
    check_writable(out.parent)
    source = check_before_merge(model)
    merged, tokenizer = merged_model(model, adapter)
    extra = {"base_model": model, "adapter_revision": adapter_revision(adapter)}
    return write_gguf(merged, tokenizer, out, gguf_type, spec=spec, source=source, extra=extra)
