"""Text generation with the same weights that embed: sampling options, stop strings, streaming, cancel.

One code path serves ``Encoder.generate``, ``unimae ask`` and the server's completions/chat routes:
``generate_stream`` runs ``model.generate`` in a worker thread and yields text pieces as tokens come,
then a :class:`GenerationResult`; ``generate_text`` collects it. A prefix ``past_key_values`` (e.g. the
KV cache of the query's embedding pass, see ``unimae.rag``) is copied and handed to ``generate``, so
only the uncached tail of the prompt is prefilled.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from unimae.precision import autocast


@dataclass
class GenerationParams:
    """Decoding options, named as in the OpenAI API; ``temperature == 0`` means greedy."""

    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens to generate."})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (with temperature > 0)."})
    stop: list[str] = field(default_factory=list, metadata={"help": "Strings that end the generation."})
    seed: int | None = field(default=None, metadata={"help": "Seed for sampling (reproducible outputs)."})

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


@dataclass
class GenerationResult:
    """What a finished generation produced; ``finish_reason`` is 'stop' or 'length' as in OpenAI."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class _Cancelled(StoppingCriteria):
    """Stops ``generate`` at the next token once ``event`` is set (client gone, server shutting down)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def generate_stream(
    model,
    tokenizer,
    input_ids: list[int],
    params: GenerationParams,
    precision: str = "fp32",
    past_key_values=None,
    cancel: threading.Event | None = None,
) -> Iterator[str | GenerationResult]:
    """Yield text pieces of the continuation of ``input_ids``, then one :class:`GenerationResult`.

    Stop strings are cut from the text (never streamed); ``past_key_values`` must hold the KV cache of a
    prefix of ``input_ids`` and is not modified. Setting ``cancel`` ends the generation within a token.
    """
    if not input_ids:
        raise ValueError("the prompt is empty")
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)  # (1, T)
    cancel = cancel or threading.Event()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=params.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
        **params.generate_kwargs(),
    )
    if params.stop:
        kwargs.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    if past_key_values is not None:
        kwargs["past_key_values"] = copy.deepcopy(past_key_values)
    outcome: dict = {}

    def run():
        try:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            with torch.inference_mode(), autocast(precision, device):
                outcome["ids"] = model.generate(**kwargs)
        except BaseException as err:  # re-raised in the caller's thread below
            outcome["error"] = err
            streamer.end()

    worker = threading.Thread(target=run, name="unimae-generate", daemon=True)
    worker.start()
    text, sent = "", 0
    try:
        for piece in streamer:
            text += piece
            visible, stopped = _cut_at_stop(text, params.stop)
            # hold back a tail that could be the start of a stop string
            hold = 0 if stopped else max((len(s) - 1 for s in params.stop), default=0)
            safe = len(visible) - hold
            if safe > sent:
                yield visible[sent:safe]
                sent = safe
            if stopped:
                cancel.set()
    finally:
        cancel.set()  # a consumer that stopped early (client gone) ends the generation; harmless after it
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    visible, stopped = _cut_at_stop(text, params.stop)
    if len(visible) > sent:
        yield visible[sent:]
    new_tokens = outcome["ids"].shape[1] - len(input_ids)
    eos_ids = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id]
    ended = new_tokens > 0 and int(outcome["ids"][0, -1]) in eos_ids
    finish = "stop" if stopped or ended or new_tokens < params.max_new_tokens else "length"
    yield GenerationResult(visible, len(input_ids), new_tokens, finish)


def generate_text(model, tokenizer, input_ids: list[int], params: GenerationParams, **kwargs) -> GenerationResult:
    """Run :func:`generate_stream` to the end and return its result."""
    for item in generate_stream(model, tokenizer, input_ids, params, **kwargs):
        if isinstance(item, GenerationResult):
            return item
    raise RuntimeError("generation ended without a result")
