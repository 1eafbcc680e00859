"""``POST /v1/rag``: retrieve passages from the index and answer from them with the same model.

Body ``{"query", "k", "max_tokens", "stream", "reuse_kv", "model"}``; answer ``rag.answer`` with the passages and
usage (``cached_prompt_tokens``: the query's embedding pass reused as the prompt's KV cache). Without
``max_tokens`` the answer may take the chat default, shortened to the context the question and passages leave.
Streamed, the events are ``rag.passages``, then ``rag.delta`` text pieces, then the ``rag.answer``. A client
that leaves ends the answer within a token, streamed or not.
"""

from __future__ import annotations

import asyncio
import functools
import threading

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from unimae.generation.sampling import GenerationParams
from unimae.retrieval.index import Hit, VectorIndexError
from unimae.retrieval.rag import RAGAnswer, passages_json
from unimae.serving.disconnect import client_gone, unless_gone
from unimae.serving.engine import run_to_end
from unimae.serving.schemas import APIError, RAGRequest, parse_request
from unimae.serving.sse import sse_events, sse_response
from unimae.serving.state import StateDep

router = APIRouter()


@router.post("/v1/rag", response_model=None)
async def rag_answer(request: Request, state: StateDep) -> dict | StreamingResponse:
    body = await parse_request(request, RAGRequest)
    state.check_model(body.model)
    engine = state.engine
    if not engine.has_index:
        raise APIError(404, "no index is loaded; start the server with --index DIR", code="no_index")
    budget = state.token_budget(body.max_tokens, state.config.default_chat_tokens)
    asked = GenerationParams(max_new_tokens=budget if body.max_tokens else 1)  # unasked: the room left (below)
    state.slots.reserve()
    try:  # retrieval and the full prompt's budget check before any answer starts: a streamed answer gets 400 too
        prompt = await run_in_threadpool(engine.rag_prepare, body.query, asked, body.k, body.reuse_kv)
    except BaseException as err:
        state.slots.unreserve()
        if isinstance(err, ValueError):
            raise _client_or_index_error(err) from err
        raise
    if not body.max_tokens and engine.context is not None:  # as chat: the default answer shrinks to fit
        budget = min(budget, engine.context - len(prompt.ids))
    params = GenerationParams(max_new_tokens=budget)
    cancel = threading.Event()
    model = state.config.model_name
    run = functools.partial(engine.rag_stream, body.query, prompt, params, cancel)
    if body.stream:
        return sse_response(sse_events(state.slots, run, functools.partial(_event, model), cancel), state.slots)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        async with state.slots.hold():
            work = run_in_threadpool(lambda: run_to_end(run()))
            answer: RAGAnswer = await unless_gone(work, gone, "its answer", stop=cancel)
    except ValueError as err:
        raise _client_or_index_error(err) from err
    finally:
        gone.cancel()
    return answer.to_json(model)


def _client_or_index_error(err: ValueError) -> APIError:
    """A question the model cannot take is the client's (400); a damaged index file is the server's (500)."""
    if isinstance(err, VectorIndexError):
        return APIError(500, f"the server's index cannot be read: {err}", code="index_damaged")
    return APIError(400, str(err), "query")


def _event(model: str, item: list[Hit] | str | RAGAnswer) -> dict:
    """One streamed payload: the retrieved passages, a text piece, or the final answer."""
    if isinstance(item, list):
        return {"object": "rag.passages", "passages": passages_json(item)}
    if isinstance(item, RAGAnswer):
        return item.to_json(model)
    return {"object": "rag.delta", "text": item}
