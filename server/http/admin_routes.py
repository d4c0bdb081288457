"""The prefix cache by hand. Its disk tier (llama.cpp's slot save and restore, by prompt): save a
prompt's pages to disk now, or read them back into host memory ahead of the request that needs
them (a 400 when the server has no disk tier). The whole cache emptied of what no request uses
(vLLM's /reset_prefix_cache, SGLang's /flush_cache, which benchmarks call before a cold run).
And /version, as vLLM answers it. Behind the API key like every route.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from kiln.runtime.errors import InvalidRequestError

from ..generation import admit
from ..prompts import encode
from ..version import kiln_version

router = APIRouter()


class KvCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None


async def _prompt_ids(body: KvCacheRequest, request: Request) -> list[int]:
    state = request.app.state
    admit(state.service, state.settings, body.model)
    if (body.prompt is None) == (body.input_ids is None):
        raise InvalidRequestError("give exactly one of prompt or input_ids")
    if body.input_ids is not None:
        return state.service.check_token_ids(body.input_ids, param="input_ids")
    return await encode(state.service, body.prompt, state.settings.max_prompt_chars)


def _answer(service, ids: list[int], pages: int) -> dict:
    stride = service.cache.block_seq_stride
    return {"prompt_tokens": len(ids), "pages": pages, "tokens": pages * stride}


@router.post("/admin/kv-cache/save")
async def save(body: KvCacheRequest, request: Request):
    """The prompt's full pages computed if need be and written to the disk tier."""
    service = request.app.state.service
    ids = await _prompt_ids(body, request)
    return _answer(service, ids, await service.save_prefix_to_disk(ids))


@router.post("/admin/kv-cache/restore")
async def restore(body: KvCacheRequest, request: Request):
    """The prompt's pages read from the disk tier into host memory; `pages` counts those the
    cache now holds in any tier."""
    service = request.app.state.service
    ids = await _prompt_ids(body, request)
    return _answer(service, ids, await service.restore_prefix_from_disk(ids))


@router.post("/reset_prefix_cache")
@router.post("/flush_cache")
@router.get("/flush_cache")  # a route per method: each its own OpenAPI operation
async def reset_prefix_cache(request: Request):
    """Every cached page no request uses dropped from the device and host tiers; requests in
    flight keep theirs."""
    return {"dropped_pages": await request.app.state.service.reset_prefix_cache()}


@router.get("/version")
async def server_version():
    return {"version": kiln_version()}
