"""Embeddings and what is built on them: OpenAI's /v1/embeddings, vLLM's /score, and the
/rerank of Jina and Cohere that vLLM also serves.

Each input is a request of its own through the engine (runtime/embedding), batched with
whatever else runs and sharing the prefix cache; the model must have been built with its embed
functions (`--embeddings`). A score is the cosine of two inputs' embeddings, as vLLM scores with
an embedding model; a ranking sorts documents by their score against the query.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.pooling import PoolingParams
from kiln.runtime.service import GenerateService

from ..generation import admit
from ..prompts import encode, prompt_forms
from ..protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from ..settings import ServerSettings
from .streaming import unless_disconnected

router = APIRouter()

MOST_INPUTS = 2048  # OpenAI's bound on one request's inputs


def check_embeddings(service: GenerateService, settings: ServerSettings, model: str | None) -> None:
    """What every route here checks first: the model's name, that it is ready, that it embeds."""
    admit(service, settings, model)
    service.check_embeddings()


def truncated(ids: list[int], keep: int | None, service: GenerateService) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = service.max_seq_len
    if keep < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                                  param="truncate_prompt_tokens")
    return ids[-keep:]


async def texts_ids(service: GenerateService, settings: ServerSettings, texts: list[str], param: str,
                    add_special_tokens: bool, keep: int | None) -> list[list[int]]:
    if "" in texts:
        raise InvalidRequestError(f"{param} holds an empty string: there is nothing to embed", param=param)
    ids = [await encode(service, text, settings.max_prompt_chars, add_special_tokens, param=param) for text in texts]
    if not all(ids):
        raise InvalidRequestError(f"{param} holds an input with no tokens", param=param)
    return [truncated(text_ids, keep, service) for text_ids in ids]


async def embeddings_of(request: Request, prompts: list[list[int]], pooling: PoolingParams,
                        priority: int) -> list[np.ndarray]:
    """Each prompt's embedding; the client leaving cancels those still running."""
    service = request.app.state.service
    return await unless_disconnected(request, service.embed(prompts, pooling, priority))


def usage(prompts: list[list[int]]) -> dict:
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32s."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.astype(np.float64).tolist()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    scale = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / scale) if scale else 0.0


# -- /v1/embeddings ---------------------------------------------------------------------------
@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request):
    state = request.app.state
    service, settings = state.service, state.settings
    check_embeddings(service, settings, body.model)
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidRequestError(f"dimensions must be a positive integer, got {body.dimensions}", param="dimensions")
    pooling = service.pooling(body.dimensions)
    texts, token_lists = prompt_forms(body.input, "input", MOST_INPUTS)
    if texts is not None:
        prompts = await texts_ids(service, settings, texts, "input", body.add_special_tokens,
                                  body.truncate_prompt_tokens)
    else:
        prompts = [truncated(service.check_token_ids(ids, "input"), body.truncate_prompt_tokens, service)
                   for ids in token_lists]
        if not all(prompts):
            raise InvalidRequestError("input holds an empty list of token ids", param="input")
    vectors = await embeddings_of(request, prompts, pooling, body.priority)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or settings.model_name,
        "data": [{"index": i, "object": "embedding", "embedding": encoded(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": usage(prompts),
    }


# -- /score and /rerank -----------------------------------------------------------------------
def score_pairs(count_1: int, count_2: int) -> list[tuple[int, int]]:
    """vLLM's pairing: one text_1 against each text_2, else text_1 and text_2 pair by pair."""
    if count_1 == 1:
        return [(0, j) for j in range(count_2)]
    if count_1 == count_2:
        return [(i, i) for i in range(count_1)]
    raise InvalidRequestError(f"text_1 has {count_1} texts and text_2 {count_2}: give one text_1, or as many as "
                              "text_2", param="text_1")


async def scores(request: Request, texts: list[str], pairs: list[tuple[int, int]], add_special_tokens: bool,
                 keep: int | None, priority: int, param: str) -> tuple[list[float], list[list[int]]]:
    """The cosine of each pair of `texts` (indices), each text embedded once; and the prompts embedded."""
    service, settings = request.app.state.service, request.app.state.settings
    if len(texts) > MOST_INPUTS:
        raise InvalidRequestError(f"at most {MOST_INPUTS} texts per request, got {len(texts)}", param=param)
    prompts = await texts_ids(service, settings, texts, param, add_special_tokens, keep)
    vectors = await embeddings_of(request, prompts, service.pooling(), priority)
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], prompts


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    state = request.app.state
    check_embeddings(state.service, state.settings, body.model)
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not first or not second:
        raise InvalidRequestError("text_1 and text_2 must each hold at least one text",
                                  param="text_1" if not first else "text_2")
    pairs = [(a, len(first) + b) for a, b in score_pairs(len(first), len(second))]
    values, prompts = await scores(request, first + second, pairs, body.add_special_tokens,
                                   body.truncate_prompt_tokens, body.priority, "text_2")
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or state.settings.model_name,
        "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(values)],
        "usage": usage(prompts),
    }


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    state = request.app.state
    check_embeddings(state.service, state.settings, body.model)
    if not body.documents:
        raise InvalidRequestError("documents must hold at least one document", param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequestError(f"top_n must be a positive integer, got {body.top_n}", param="top_n")
    values, prompts = await scores(request, [body.query, *body.documents],
                                   [(0, 1 + i) for i in range(len(body.documents))], body.add_special_tokens,
                                   body.truncate_prompt_tokens, body.priority, "documents")
    ranked = sorted(range(len(values)), key=lambda i: -values[i])[: body.top_n]
    results = [{"index": i, "relevance_score": values[i]} | ({"document": {"text": body.documents[i]}}
                                                             if body.return_documents else {})
               for i in ranked]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or state.settings.model_name,
            "results": results, "usage": {"total_tokens": usage(prompts)["total_tokens"]}}
