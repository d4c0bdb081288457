"""shortfin's /generate (POST or PUT): `text` or `input_ids`, one prompt or a batch, and its response shape.

    {"responses": [{"prompt": "...", "responses": [{"text": "..."}]}]}

`return_input_ids` answers the generated token ids instead, as shortfin does. With `stream`,
each event is `data: {"rid", "prompt_index", "index", "text", "token_ids", "finish_reason"}`
(JSON, so text with newlines stays one event), ending with `data: [DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.runtime.errors import InvalidRequestError

from ..errors import error_body, failure_of
from ..generation import Generation, admit, check_n
from ..params import shortfin_params
from ..prompts import encode
from ..protocol import GenerateRequest
from .streaming import DONE, EventStream, sse, unless_disconnected

router = APIRouter()


async def prompts_of(service, body: GenerateRequest, limit: int) -> tuple[list[list[int]], list[str], bool]:
    """(token ids, text, whether the request is a single prompt)."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("Either text or input_ids should be provided.")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else list(body.text)
        return [await encode(service, t, limit, param="text") for t in texts], texts, single
    single = not body.input_ids or isinstance(body.input_ids[0], int)
    given = [body.input_ids] if single else body.input_ids
    prompts = [service.check_token_ids(p, param="input_ids") for p in given]
    return prompts, [service.decode(p, skip_special_tokens=False) for p in prompts], single


def request_ids(body: GenerateRequest, count: int, single: bool) -> list[str]:
    if body.rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    rids = [body.rid] if isinstance(body.rid, str) and single else body.rid
    if not isinstance(rids, list) or len(rids) != count:
        raise InvalidRequestError(f"The rid should be a list of {count} ids, one per prompt.", param="rid")
    return rids


@router.put("/generate", operation_id="generate_put")
@router.post("/generate", operation_id="generate")
async def generate(body: GenerateRequest, request: Request):
    state = request.app.state
    service, settings = state.service, state.settings
    admit(service, settings, None)
    prompts, texts, single = await prompts_of(service, body, settings.max_prompt_chars)
    if not prompts or len(prompts) > settings.max_prompts:
        raise InvalidRequestError(f"give between 1 and {settings.max_prompts} prompts, got {len(prompts)}")
    sampling = body.sampling_params
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise InvalidRequestError(f"sampling_params has {len(sampling)} entries for {len(prompts)} prompts",
                                      param="sampling_params")
    else:
        sampling = [sampling] * len(prompts)
    params = [shortfin_params(sp) for sp in sampling]
    check_n(settings, [p.n for p in params])
    rids = request_ids(body, len(prompts), single)
    generation = await Generation(service, settings, state.metrics, prompts, params, rids).submit()
    if body.stream:
        return EventStream(stream_generate(generation, rids, request.url.path), on_close=generation.abort)
    results = await unless_disconnected(request, generation.collect())
    for result in results:
        for choice in result.choices:
            if (error := failure_of(choice)) is not None:
                raise error
    if body.return_input_ids:
        ids = [[c.token_ids for c in r.choices] if len(r.choices) > 1 else r.choices[0].token_ids for r in results]
        return JSONResponse(ids[0] if single else ids)
    return JSONResponse({"responses": [
        {"prompt": text, "responses": [response_of(c) for c in result.choices]}
        for text, result in zip(texts, results)
    ]})


def response_of(choice) -> dict:
    """One completion as shortfin's response, with a beam's summed log-probability (ranked best first)."""
    if choice.cumulative_logprob is None:
        return {"text": choice.text}
    return {"text": choice.text, "cumulative_logprob": choice.cumulative_logprob}


async def stream_generate(generation: Generation, rids: list[str], path: str) -> AsyncIterator[bytes]:
    events = generation.events()
    try:
        async for i, event in events:
            if (error := failure_of(event)) is not None:
                yield sse({**error_body(path, error), "rid": rids[i]})
                break
            yield sse({"rid": rids[i], "prompt_index": i, "index": event.index, "text": event.text,
                       "token_ids": event.token_ids, "finish_reason": event.finish_reason})
    finally:
        await events.aclose()
    yield DONE
