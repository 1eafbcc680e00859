"""Settings of ``unimae serve``: served model id, API key, CORS, request limits, batching (one flag each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePath


@dataclass
class ServerConfig:
    """Limits and behaviour of ``unimae serve`` (each is a ``--flag``)."""

    model_name: str = field(
        default="unimae",
        metadata={
            "help": "Model id the API reports and accepts. Not given, `unimae serve` names it after the model: "
            "a name or Hugging Face id as given (smollm2-135m), a local directory by its name, a GGUF by the model "
            "it was exported from (with --index: the index's model); the value below is ServerConfig()'s only."
        },
    )
    api_key: str | None = field(default=None, metadata={"help": "Require 'Authorization: Bearer KEY' (not /health)."})
    cors_origins: str | None = field(
        default=None,
        metadata={
            "help": "Browser origins allowed to call the API, comma-separated (https://app.example.com), or '*' "
            "for any: CORS headers, and preflight OPTIONS answered before the API key is checked. Off when not given."
        },
    )
    max_inputs: int = field(
        default=2048,
        metadata={"help": "Most texts in one embeddings request (OpenAI's limit)."},
    )
    max_prompts: int = field(
        default=32,
        metadata={
            "help": "Most prompts in one completions request (a list of prompts: generated one after another in "
            "the request's one slot; LangChain's default batch of 20 fits)."
        },
    )
    on_too_long: str = field(
        default="truncate",
        metadata={
            "help": "An embedding input over --max-length tokens: truncate it (one warning in the log), or error: "
            "a 400 naming the input, nothing logged.",
            "choices": ("truncate", "error"),
        },
    )
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "Largest request body accepted."})
    max_new_tokens: int = field(default=512, metadata={"help": "Largest max_tokens a request may ask for."})
    default_chat_tokens: int = field(default=256, metadata={"help": "max_tokens of chat/RAG when not given."})
    continuous_batching: bool = field(
        default=True,
        metadata={
            "help": "Decode concurrent generations together, one token each per step; a new request joins the "
            "running batch at the next step (--no-continuous-batching: each generation in a thread of its own)."
        },
    )
    max_batch_generations: int = field(
        default=8, metadata={"help": "Continuous batching: most generations decoded together; more wait in the queue."}
    )
    max_concurrent_generations: int = field(
        default=1, metadata={"help": "With --no-continuous-batching: generations running at once."}
    )
    max_queued_generations: int = field(default=32, metadata={"help": "Generations waiting; more get 429."})
    max_request_tokens: int = field(
        default=300_000,
        metadata={
            "help": "Most tokens (after truncation, with special tokens) in one embeddings request; 413 beyond "
            "(OpenAI's limit)."
        },
    )
    embed_chunk_tokens: int = field(
        default=512,
        metadata={
            "help": "Padded tokens per embedding forward pass: larger requests are split into chunks this size, "
            "interleaved with other requests (a new request waits at most about one chunk). Raise it on a GPU."
        },
    )
    batch_max_texts: int = field(default=64, metadata={"help": "Most texts per batched embedding forward pass."})
    batch_wait_ms: float = field(default=10.0, metadata={"help": "Longest wait for more requests to batch."})
    body_timeout_s: float = field(
        default=30.0,
        metadata={"help": "Longest wait for the next part of a request body; 408 and the connection closed after."},
    )
    keep_alive_s: float = field(
        default=5.0, metadata={"help": "An idle keep-alive connection is closed after this many seconds."}
    )
    header_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "Longest wait for a request's complete headers, from the connection's opening (later: from the "
            "first byte of the next request), however the bytes trickle in; the connection is closed after "
            "(with a 408 if part of a request came)."
        },
    )

    def __post_init__(self):
        positive = (
            "max_inputs",
            "max_prompts",
            "max_body_bytes",
            "max_new_tokens",
            "max_batch_generations",
            "max_concurrent_generations",
            "max_request_tokens",
            "embed_chunk_tokens",
            "batch_max_texts",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("body_timeout_s", "keep_alive_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.on_too_long not in ("truncate", "error"):
            raise ValueError(f"on_too_long must be 'truncate' or 'error', got {self.on_too_long!r}")
        check_api_key(self.api_key)
        self.cors_origin_list()

    def cors_origin_list(self) -> list[str]:
        """The origins of ``cors_origins`` (none: CORS is off); a ValueError for an empty one ("a,,b")."""
        if self.cors_origins is None:
            return []
        origins = [origin.strip() for origin in self.cors_origins.split(",")]
        if not all(origins):
            raise ValueError(f"cors_origins must be comma-separated origins or '*', got {self.cors_origins!r}")
        return origins


def check_api_key(key: str | None) -> str | None:
    """``key`` if a client can send it: printable ASCII without surrounding spaces. HTTP carries header bytes
    that servers read as latin-1 and clients encode variously, so a key with 'é' would lock everyone out."""
    if key is not None and not (key.isascii() and key.isprintable() and key == key.strip()):
        raise ValueError(
            "the API key must be printable ASCII without leading or trailing spaces (HTTP headers cannot carry "
            "other characters reliably, so no client could send it); choose another key, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return key


def model_id(source: str) -> str:
    """The served model id of a model named ``source`` (both engines): a name or Hugging Face id as given
    (``smollm2-135m``, ``HuggingFaceTB/SmolLM2-135M``), a local directory or file by its last part without a
    ``.gguf`` suffix. The llama.cpp engine applies it to the model a unimae GGUF was exported from, so both
    engines serving the same model answer to the same id."""
    path = PurePath(source)
    if Path(source).exists() or path.is_absolute() or source.startswith("."):
        return path.name.removesuffix(".gguf")
    return source
