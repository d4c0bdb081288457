"""/ws: tokens both ways over one WebSocket, for clients that prefer it to SSE.

Client → server, one JSON object per message:
    {"type": "generate", "id": "a", "prompt": "..." | "input_ids": [...] | "messages": [...], <sampling fields>}
    {"type": "cancel", "id": "a"}
Server → client:
    {"type": "token", "id", "index", "text", "token_ids", "logprobs"?, "finish_reason"}
    {"type": "done", "id", "choices": [{"index", "text", "finish_reason"}], "usage"}   (or "cancelled": true)
    {"type": "error", "id", "error": {"message", "type", "param", "code"}}
Several generations may run at once on one socket; closing it aborts them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from kiln.runtime.errors import InvalidRequestError, KilnError

from ..errors import error_body, failure_of
from ..generation import Choice, Generation, adapter_of, admit, rest_of_context
from ..params import check_logprobs, openai_params
from ..prompts import chat_ids, encode
from ..protocol import SocketCancel, SocketGenerate
from .middleware import RATE_LIMIT_STATE

router = APIRouter()


class Session:
    def __init__(self, websocket: WebSocket):
        self.websocket = websocket
        self.state = websocket.app.state
        self.running: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()

    async def send(self, payload: dict) -> None:
        async with self._lock:  # one message at a time, whichever generation it is from
            await self.websocket.send_text(json.dumps(payload, ensure_ascii=False))

    async def error(self, generation_id: str | None, error: KilnError) -> None:
        await self.send({"type": "error", "id": generation_id, **error_body("/ws", error)})

    async def handle(self, raw: str) -> None:
        try:
            data = json.loads(raw)
        except ValueError as problem:
            return await self.error(None, InvalidRequestError(f"messages must be JSON objects: {problem}"))
        kind = data.get("type") if isinstance(data, dict) else None
        try:
            if kind == "generate":
                return await self.start(SocketGenerate.model_validate(data))
            if kind == "cancel":
                return await self.cancel(SocketCancel.model_validate(data).id)
        except ValidationError as problem:
            first = problem.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return await self.error(data.get("id"), InvalidRequestError(f"{where}: {first['msg']}",
                                                                        param=where or None))
        except KilnError as problem:
            return await self.error(data.get("id"), problem)
        await self.error(data.get("id") if isinstance(data, dict) else None,
                         InvalidRequestError("type must be 'generate' or 'cancel'", param="type"))

    async def start(self, message: SocketGenerate) -> None:
        generation_id = message.id or uuid.uuid4().hex
        if generation_id in self.running:
            raise InvalidRequestError(f"a generation with id {generation_id!r} is already running", param="id")
        check_rate_limit = self.websocket.scope.get("state", {}).get(RATE_LIMIT_STATE)
        if check_rate_limit is not None:  # every generation counts, not the handshake
            check_rate_limit()
        generation, logprobs = await self.prepare(message, generation_id)
        task = asyncio.create_task(self.stream(generation_id, generation, logprobs, message.n))
        self.running[generation_id] = task
        task.add_done_callback(lambda _: self.running.pop(generation_id, None))

    async def prepare(self, message: SocketGenerate, generation_id: str) -> tuple[Generation, int | None]:
        service, settings = self.state.service, self.state.settings
        admit(service, settings, message.model, [message.n])
        given = [x is not None for x in (message.prompt, message.input_ids, message.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, input_ids or messages")
        if message.messages is not None:
            prompt = await chat_ids(service, message.messages, settings.chat_template, settings.max_prompt_chars,
                                    bool(message.add_special_tokens))
        elif message.prompt is not None:
            prompt = await encode(service, message.prompt, settings.max_prompt_chars,
                                  add_special_tokens=message.add_special_tokens is not False)
        else:
            prompt = service.check_token_ids(message.input_ids, param="input_ids")
        max_tokens = message.max_tokens
        if max_tokens is None:
            max_tokens = rest_of_context(service, prompt) if message.messages is not None else 16
        logprobs = check_logprobs(message.logprobs, "logprobs")
        params = openai_params(message, max_tokens, logprobs, model_defaults=service.generation_defaults,
                               lora=adapter_of(service, message.model))
        generation = Generation(service, settings, self.state.metrics, [prompt], [params],
                                [f"ws-{uuid.uuid4().hex}"], message.priority)
        return await generation.submit(), logprobs

    async def stream(self, generation_id: str, generation: Generation, logprobs: int | None, n: int) -> None:
        try:
            await self._stream(generation_id, generation, logprobs, n)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the socket closed under us: leaving events() aborted the generation

    async def _stream(self, generation_id: str, generation: Generation, logprobs: int | None, n: int) -> None:
        choices = [Choice() for _ in range(n)]
        async with contextlib.aclosing(generation.events()) as events:
            async for _, event in events:
                if (error := failure_of(event)) is not None:
                    return await self.error(generation_id, error)
                choices[event.index].add(event)
                token = {"type": "token", "id": generation_id, "index": event.index, "text": event.text,
                         "token_ids": event.token_ids, "finish_reason": event.finish_reason}
                if logprobs is not None:
                    token["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                                          "top": {str(t): v for t, v in lp.top.items()}} for lp in event.logprobs]
                await self.send(token)
        await self.send({"type": "done", "id": generation_id, "usage": generation.usage().to_json(), "choices": [
            {"index": j, "text": c.text, "finish_reason": c.finish_reason} for j, c in enumerate(choices)]})

    async def cancel(self, generation_id: str) -> None:
        task = self.running.get(generation_id)
        if task is None:
            raise InvalidRequestError(f"no generation with id {generation_id!r} is running", param="id")
        task.cancel()  # leaving generation.events() aborts it
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.send({"type": "done", "id": generation_id, "cancelled": True, "choices": []})

    async def close(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        for task in list(self.running.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@router.websocket("/ws")
async def socket(websocket: WebSocket):
    await websocket.accept()
    session = Session(websocket)
    sessions = websocket.app.state.sockets
    sessions.add(session)
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw = message.get("text")
            if raw is None:
                raw = (message.get("bytes") or b"").decode("utf-8", errors="replace")
            await session.handle(raw)
    finally:
        sessions.discard(session)
        await session.close()
