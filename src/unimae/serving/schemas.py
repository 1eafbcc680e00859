"""OpenAI-format request bodies (pydantic), their parsing, the response bodies both engines share, and the
OpenAI-style error body.

Only what unimae serves is accepted; unknown fields are ignored as OpenAI clients send extras
(``user``, ``logit_bias`` ...). Values outside what the model can do are 400s, not silent changes: tool calling
(``tools``, ``functions``, tool messages), structured output (``response_format`` other than text) and
logprobs (``echo`` too) are refused naming the field, not answered as if they had not been asked. An explicit
``null`` on an optional field means its default (the OpenAI spec marks them nullable). A string
that UTF-8 cannot encode (JSON allows a lone UTF-16 surrogate such as ``"\\ud800"``; the tokenizer and the
response encoder do not) is a 400 naming its field, wherever it is in the body. An embedding the model gave as
NaN or infinite is never sent (as a 500 from the JSON encoder, or as NaN bytes in base64): it is a 422 naming
the input and the cause; so is a generation whose next-token scores are NaN or infinite.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any, Literal, TypeVar, get_args

import numpy as np
from pydantic import BaseModel, Field, StrictInt, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error returned to the client as ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message, param = _printable(message), _printable(param)  # the body must encode, whatever was echoed
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "server_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


async def parse_request(request: Request, schema: type[Body]) -> Body:
    """The request's body as ``schema`` (:func:`parse_body`), parsed in a worker thread: a body of a few MB
    takes tens of milliseconds to parse, which would stall every other request on the event loop."""
    return await run_in_threadpool(parse_body, await request.body(), schema)


def parse_body(raw: bytes, schema: type[Body]) -> Body:
    """A request body -> ``schema``, or a 400 naming the first thing wrong (bad JSON, not an object, a string
    that is not valid Unicode, a field)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise APIError(400, f"the request body is not valid JSON: {type(err).__name__}: {err}") from err
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) or not json.detect_encoding(raw).startswith("utf-8"):
        _check_unicode(data)  # in UTF-8, only a \uD800-\uDFFF escape can put a surrogate in the parsed body
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise validation_error(err, schema) from err


def validation_error(err: ValidationError, schema: type[BaseModel]) -> APIError:
    """The 400 of a body ``schema`` refused: the first field wrong, named by its path in the body (``stop``,
    ``messages.0.content``), never by pydantic's union member tags (``stop.str``, ``content.list[any]``).

    A value no member of a union takes fails once per member, at the same field (``"stop": 5``: not a string,
    not a list): the message names what each wanted. When one member got further into the value (``"stop":
    [5]``: a list, but of no strings), its deeper error is the one reported (``stop.0``)."""
    errors = [(field_path(schema, e["loc"]), e) for e in err.errors()]
    where = errors[0][0]
    same_field = [(path, e) for path, e in errors if path[: len(where)] == where] if where else errors[:1]
    where = max(same_field, key=lambda item: len(item[0]))[0]  # the first of the deepest
    messages = [_message(e) for path, e in same_field if path == where]
    message = messages[0]
    if len(messages) > 1 and all(m.startswith("Input should be ") for m in messages):
        wanted = dict.fromkeys(m.removeprefix("Input should be ") for m in messages)  # distinct, in order
        message = "Input should be " + " or ".join(wanted)
    param = ".".join(str(p) for p in where) or None
    return APIError(400, f"invalid '{param}': {message}" if param else message, param=param)


def _message(error: dict) -> str:
    if error["type"] == "finite_number":  # "NaN", "inf": not "must be <= 2"
        return "must be a finite number"
    return error["msg"].removeprefix("Value error, ")


def field_path(schema: type[BaseModel], loc: tuple) -> tuple:
    """A pydantic error location -> the path of the field in the body: field names and list indexes, without the
    tags pydantic puts between them for the member of a union it tried (``str``, ``list[str]``, ``int``,
    ``function-after[...]`` ...). A name is kept where it is a field of the model at that depth (nested models
    found through lists and unions: ``messages.0.content``); anything else is such a tag (the schemas have no
    typed dicts, whose keys would be dropped too)."""
    path, model = [], schema
    for item in loc:
        if isinstance(item, int):
            path.append(item)  # a list index: the items are of the model the list holds, if any
        elif model is not None and item in model.model_fields:
            path.append(item)
            model = _model_in(model.model_fields[item].annotation)
    return tuple(path)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (``list[ChatMessage]``, ``StreamOptions | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(data: dict) -> None:
    """400 naming the first string (key or value, in document order) that UTF-8 cannot encode: one with a
    lone surrogate (a valid surrogate pair is one character once parsed). Fields are named as pydantic does."""
    stack: list[tuple[tuple, Iterator]] = [((), iter(data.items()))]
    while stack:
        path, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        key, value = entry
        where = (*path, key)
        for text in (key, value):
            if isinstance(text, str):
                _check_string(where, text)
        if isinstance(value, dict):
            stack.append((where, iter(value.items())))
        elif isinstance(value, list):
            stack.append((where, enumerate(value)))


def _check_string(path: tuple, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = ".".join(_printable(str(p)) for p in path)
        raise APIError(
            400,
            f"invalid '{where}': the text is not valid Unicode (a lone UTF-16 surrogate, U+{ord(text[err.start]):04X}, "
            f"at character {err.start}); send UTF-8 text",
            param=where,
        ) from None


def _printable(text: str | None) -> str | None:
    """``text`` with anything UTF-8 cannot encode written as a ``\\udXXX`` escape."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _as_list(value, name: str) -> list[str]:
    """A string or a list of strings -> list of strings; token arrays are refused with a clear message."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f"'{name}' must be a non-empty string or a non-empty list of strings")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValueError(f"'{name}[{i}]' is a {type(item).__name__}; send text (token arrays are not supported)")
    return items


class _Body(BaseModel):
    """A request body: a JSON ``null`` on a field that has a default means that default, as if left out (the
    OpenAI spec marks them nullable, and the openai SDK sends ``null`` for a ``None`` a wrapper passes on)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


NO_TOOLS = "this server does not do tool calling (no tools, functions, tool calls or tool results)"
NO_LOGPROBS = "this server does not return logprobs"


class EmbeddingRequest(_Body):
    input: str | list = Field(description="A text or a list of texts.")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # 256, not "256", 256.0 or true
    input_type: Literal["query", "document"] | None = Field(
        default=None, description="'query' or 'document': embed with the model's prompt of that name (if it has one)."
    )

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, value):
        return _as_list(value, "input")


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage and no choices, as OpenAI sends it


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # "NaN": "a finite number"
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # OpenAI's int64; see sampling_seed
    response_format: dict | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value.get("type") != "text":
            raise ValueError(
                f"structured output (type {value.get('type')!r}) is not supported: this server generates free text "
                'only; leave response_format out or send {"type": "text"}'
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("'stop' takes up to 4 non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def sampling_seed(self) -> int | None:
        """``seed`` as the generator takes it: an int64 (negative ones too) mapped onto [0, 2**64), one to one."""
        return None if self.seed is None else self.seed % 2**64


class CompletionRequest(_Sampling):
    prompt: str | list  # one text or several (one choice each); token arrays are refused
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        return _as_list(value, "prompt")

    @field_validator("logprobs", "echo")
    @classmethod
    def _no_logprobs(cls, value, info):
        if value:  # echo returns the prompt with its logprobs
            raise ValueError(f"{NO_LOGPROBS} ({info.field_name} is not supported); leave it out, or send 0 / false")
        return value


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list | None = None
    tool_calls: list | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_results(cls, value):
        if value in ("tool", "function"):
            raise ValueError(f"{NO_TOOLS}: a message of role {value!r} (a tool's result) cannot be answered")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        if value:
            raise ValueError(f"{NO_TOOLS}: an assistant message cannot carry tool_calls")
        return value

    @field_validator("content")
    @classmethod
    def _text(cls, value):
        """Text, or OpenAI content parts of type "text" (joined by newlines); other part types are refused."""
        if value is None or isinstance(value, str):
            return value or ""
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}]: only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins them

    def as_template_message(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tool_choice: str | dict | None = None  # before tools and functions: their validators read it
    function_call: str | dict | None = None
    tools: list | None = None
    functions: list | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value, info):
        if value:
            raise ValueError(f"{NO_LOGPROBS} ({info.field_name} is not supported); leave it out, or send false / 0")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        """Tools the model may call are refused, unless the request says not to call any (choice "none")."""
        choice = "tool_choice" if info.field_name == "tools" else "function_call"
        if value and info.data.get(choice) != "none":
            raise ValueError(f'{NO_TOOLS}; send the request without {info.field_name} (or with {choice} "none")')
        return value

    def model_post_init(self, context) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


class RAGRequest(_Body):
    query: str = Field(min_length=1, max_length=4000)
    model: str | None = None  # as on the OpenAI routes: another model's name is a 404
    k: int = Field(default=3, ge=1, le=50)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    reuse_kv: bool = True

    @field_validator("query")
    @classmethod
    def _query(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value


def check_dimensions(dimensions: int | None, full: int, trained: tuple[int, ...], rotated: bool = False) -> None:
    """400 unless ``dimensions`` (the OpenAI API's field) is absent, the full size, or a prefix size from 1 to the
    full size of a model trained with Matryoshka dimensions (``trained``: the sizes it was trained for) or with a
    Matryoshka rotation (``rotated``)."""
    if dimensions is None or dimensions == full:
        return
    if not 1 <= dimensions <= full:
        raise APIError(400, f"dimensions must be from 1 to {full}, got {dimensions}", "dimensions")
    if not trained and not rotated:
        raise APIError(
            400,
            f"this model gives {full}-dimensional embeddings only: it was not trained for shorter ones "
            "(train with --matryoshka-dims)",
            "dimensions",
        )


def embeddings_json(model: str, vectors: np.ndarray, encoding_format: str, tokens: int) -> bytes:
    """The OpenAI embeddings response for (N, D) ``vectors``, as compact JSON: float lists, or base64 of
    little-endian float32; ``usage`` counts the ``tokens`` embedded. 422 if a vector holds NaN or infinite values.

    Written row by row: its peak memory is about the body's size (2048 x 576 floats: 23 MB), where the whole body
    as Python floats first, then as JSON pieces, took 3.5 times that."""
    check_finite_vectors(vectors)
    out = io.BytesIO()
    out.write(b'{"object":"list","data":[')
    for i, vector in enumerate(vectors):
        if encoding_format == "base64":
            encoded = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            encoded = vector.tolist()
        out.write(b"," if i else b"")
        out.write(_json({"object": "embedding", "index": i, "embedding": encoded}))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    out.write(b'],"model":' + _json(model) + b',"usage":' + _json(usage) + b"}")
    return out.getvalue()


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def check_finite_vectors(vectors: np.ndarray) -> None:
    """422 naming the first input whose embedding holds NaN or infinite values (logged for the operator: every
    input giving one means damaged weights)."""
    bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1)) if vectors.size else []
    if len(bad):
        logger.error("the model gave non-finite embeddings for %d of %d inputs", len(bad), len(vectors))
        raise APIError(
            422,
            f"the model gave a NaN or infinite embedding for input[{bad[0]}] ({len(bad)} of {len(vectors)} inputs): "
            "its weights are damaged or overflow on this text; nothing was sent. If every input fails, the server's "
            "model or adapter needs to be loaded again",
            "input",
            "non_finite_embedding",
        )


def non_finite_logits(err: Exception) -> APIError:
    """422 for a generation the model's NaN or infinite next-token scores stopped (``NonFiniteLogitsError``),
    logged for the operator in one line, as a NaN embedding is."""
    logger.error("a generation stopped: %s", err)
    return APIError(
        422,
        f"{err}; the generation stopped. If every prompt fails, the server's model or adapter needs to be loaded again",
        None,
        "non_finite_logits",
    )


def models_body(model: str) -> dict:
    """``GET /v1/models``: the one model a server serves."""
    return {"object": "list", "data": [model_body(model)]}


def model_body(model: str) -> dict:
    """``GET /v1/models/{model}``: the served model, in OpenAI's model object."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "unimae"}
