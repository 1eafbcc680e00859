"""``POST /v1/rag``: retrieve passages from the index and answer from them with the same model.

Body ``{"query", "k", "max_tokens", "stream", "reuse_kv"}``; answer ``rag.answer`` with the passages and
usage (``cached_prompt_tokens``: the query's embedding pass reused as the prompt's KV cache). Streamed, the
events are ``rag.passages``, then ``rag.delta`` text pieces, then the ``rag.answer``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from unimae.generation.sampling import GenerationParams
from unimae.retrieval.index import Hit
from unimae.retrieval.rag import RAGAnswer, passages_json
from unimae.serving.schemas import APIError, RAGRequest, parse_request
from unimae.serving.sse import sse_events, sse_response
from unimae.serving.state import StateDep

router = APIRouter()


@router.post("/v1/rag", response_model=None)
async def rag_answer(request: Request, state: StateDep) -> dict | StreamingResponse:
    body = await parse_request(request, RAGRequest)
    if state.rag is None:
        raise APIError(404, "no index is loaded; start the server with --index DIR", code="no_index")
    params = GenerationParams(max_new_tokens=state.token_budget(body.max_tokens, state.config.default_chat_tokens))
    try:
        state.rag.check_budget(body.query, params.max_new_tokens)
    except ValueError as err:
        raise APIError(400, str(err), "query") from err
    state.slots.reserve()
    try:  # retrieval and the full prompt's budget check before any answer starts: a streamed answer gets 400 too
        prompt = await run_in_threadpool(
            state.rag.prepare, body.query, params, k=body.k, reuse_kv=body.reuse_kv, on_model=state.lock.run
        )
    except BaseException as err:
        state.slots.unreserve()
        if isinstance(err, ValueError):
            raise APIError(400, str(err), "query") from err
        raise
    cancel = threading.Event()
    run = functools.partial(
        state.rag.stream, body.query, params=params, cancel=cancel, decode=state.decode, prompt=prompt
    )
    model = state.config.model_name
    if body.stream:
        return sse_response(sse_events(state.slots, run, functools.partial(_event, model), cancel), state.slots)
    async with state.slots.hold():
        try:
            answer = await run_in_threadpool(_last_answer, run)
        except ValueError as err:
            raise APIError(400, str(err), "query") from err
    return answer.to_json(model)


def _last_answer(run: Callable[[], Iterator[list[Hit] | str | RAGAnswer]]) -> RAGAnswer:
    return [item for item in run() if isinstance(item, RAGAnswer)][0]


def _event(model: str, item: list[Hit] | str | RAGAnswer) -> dict:
    """One streamed payload: the retrieved passages, a text piece, or the final answer."""
    if isinstance(item, list):
        return {"object": "rag.passages", "passages": passages_json(item)}
    if isinstance(item, RAGAnswer):
        return item.to_json(model)
    return {"object": "rag.delta", "text": item}
