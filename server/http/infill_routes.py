"""llama.cpp's /infill: fill-in-the-middle as editor plug-ins ask for it (llama.vscode, llama.vim),
for code models with FIM tokens (server/fill_in_middle.py).

The prompt is llama.cpp's: the text typed at the cursor (`prompt`) goes after `input_prefix`;
other files of the repository (`input_extra`) come first, in the model's repository-level format
where it has one (Qwen2.5-Coder's `<|repo_name|>` and `<|file_sep|>`, StarCoder's `<reponame>` and
`<file_sep>`), else as snippets. What does not fit is cut as llama.cpp cuts it: of a batch of at
most 2,048 tokens, the prefix keeps its last three quarters (the end nearest the cursor), the suffix
its first part, and the other files what is left of the context, their last tokens (here at least
half of a context shorter than two batches, where llama.cpp would leave them none). The answer is
llama.cpp's too: `content`, `stop`, `stop_type` (`eos`, `word`, `limit`), `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `truncated` and `timings`, whole or as `data:` chunks, the
last with `stop: true`. `t_max_predict_ms` ends a fill that long after it began once it holds a
newline, as llama.cpp does to keep an editor's suggestions quick.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling import SamplingParams

from ..errors import error_body, failure_of
from ..fill_in_middle import FillInMiddle
from ..generation import Generation, adapter_of, admit, rest_of_context
from ..prompts import encode
from ..protocol import InfillRequest
from .streaming import EventStream, sse, unless_disconnected

router = APIRouter()

BATCH = 2048  # llama.cpp's default batch, which the prefix and suffix share 3:1
SNIPPET = "\n\n--- snippet ---\n\n"  # between other files, for a model with no file separator


@router.post("/infill")
async def infill(body: InfillRequest, request: Request):
    state = request.app.state
    service, settings = state.service, state.settings
    admit(service, settings, body.model)
    fim = FillInMiddle.of(service.tokenizer)
    if fim is None:
        raise InvalidRequestError("/infill needs a fill-in-the-middle model (a code model whose vocabulary has "
                                  "<|fim_prefix|>, <fim_prefix> or DeepSeek-Coder's FIM tokens): this one has none",
                                  param="input_prefix")
    prompt, truncated = await infill_prompt(service, settings.max_prompt_chars, fim, body)
    max_tokens = body.n_predict if body.n_predict > 0 else rest_of_context(service, prompt)
    params = SamplingParams.from_kwargs(
        max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        repetition_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop or None, stop_token_ids=list(fim.ends),
        seed=body.seed if body.seed is not None and body.seed >= 0 else None, lora=adapter_of(service, body.model))
    generation = await Generation(service, settings, state.metrics, [prompt], [params],
                                  [f"infill-{uuid.uuid4().hex}"]).submit()
    fill = Fill(generation, body, settings.model_name, len(prompt), truncated)
    if body.stream:
        return EventStream(fill.stream(request.url.path), on_close=generation.abort)
    await unless_disconnected(request, fill.run())
    return JSONResponse(fill.answer())


async def infill_prompt(service, limit: int, fim: FillInMiddle, body: InfillRequest) -> tuple[list[int], bool]:
    """The ids the model reads, and whether any part was cut to fit."""
    async def ids(text: str, param: str) -> list[int]:
        return await encode(service, text, limit, add_special_tokens=False, param=param) if text else []

    lead = await encode(service, "", limit)  # a BOS, where the tokenizer adds one
    prefix = await ids(body.input_prefix, "input_prefix") + await ids(body.prompt, "prompt")
    suffix = await ids(body.input_suffix, "input_suffix")
    context = []
    if body.input_extra:
        if fim.repository is not None:
            context += [fim.repository, *await ids("myproject\n", "input_extra")]
        for chunk in body.input_extra:
            if fim.file_separator is not None:
                context += [fim.file_separator, *await ids(chunk.filename + "\n", "input_extra")]
            else:
                context += await ids(SNIPPET, "input_extra")
            context += await ids(chunk.text, "input_extra")
        if fim.file_separator is not None:  # the file being edited comes last
            context += [fim.file_separator, *await ids("filename\n", "input_extra")]
    reserved = body.n_predict if body.n_predict > 0 else service.max_seq_len // 4
    room = service.max_seq_len - reserved - len(lead) - 3  # the three FIM tokens
    if room < 1:
        raise InvalidRequestError(f"n_predict ({body.n_predict}) leaves no room for a prompt in this model's "
                                  f"context of {service.max_seq_len} tokens", param="n_predict")
    # The prefix and suffix share a batch of at most BATCH tokens, 3:1 (the suffix takes what the
    # prefix leaves); the other files take the rest of the room, at least half of a short one.
    batch = min(BATCH, room - min(len(context), room // 2))
    prefix_kept = prefix[len(prefix) - min(len(prefix), 3 * batch // 4):]
    suffix_kept = suffix[:batch - len(prefix_kept)]
    context_room = room - len(prefix_kept) - len(suffix_kept)
    context_kept = context[len(context) - min(len(context), context_room):]
    truncated = (len(prefix_kept), len(suffix_kept), len(context_kept)) != (len(prefix), len(suffix), len(context))
    return fim.prompt(lead, prefix_kept, suffix_kept, context_kept), truncated


class Fill:
    """One /infill generation, read to its end or to its time limit, and shown as llama.cpp does."""

    def __init__(self, generation: Generation, body: InfillRequest, model: str, prompt_tokens: int, truncated: bool):
        self.generation, self.body, self.model = generation, body, model
        self.prompt_tokens, self.truncated = prompt_tokens, truncated
        self.content, self.tokens = "", 0
        self.stop_type, self.stopping_word = "none", ""
        self.started = time.monotonic()
        self.first_token_at: float | None = None

    def take(self, update) -> bool:
        """Add one event's text; whether the fill is over (ended, or past its time limit)."""
        self.content += update.text
        self.tokens += len(update.token_ids)
        now = time.monotonic()
        if update.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if update.finish_reason:
            if update.finish_reason == "length":
                self.stop_type = "limit"
            elif isinstance(update.stop_reason, str):
                self.stop_type, self.stopping_word = "word", update.stop_reason
            else:
                self.stop_type = "eos"
            return True
        limit = self.body.t_max_predict_ms
        if limit > 0 and "\n" in self.content and (now - self.started) * 1000 >= limit:
            self.stop_type = "limit"
            return True
        return False

    async def run(self) -> None:
        async with contextlib.aclosing(self.generation.events()) as events:  # leaving early aborts
            async for _, update in events:
                if (error := failure_of(update)) is not None:
                    raise error
                if self.take(update):
                    break

    def answer(self, content: str | None = None) -> dict:
        """The whole answer (llama.cpp's /completion fields), or the last chunk's with its text."""
        now = time.monotonic()
        first = self.first_token_at or now
        cached = self.generation.usage().cached_tokens
        prompt_ms, predicted_ms = (first - self.started) * 1000, (now - first) * 1000
        return {
            "index": 0, "content": self.content if content is None else content, "tokens": [], "id_slot": 0,
            "stop": True, "model": self.model, "tokens_predicted": self.tokens,
            "tokens_evaluated": self.prompt_tokens, "tokens_cached": cached, "truncated": self.truncated,
            "has_new_line": "\n" in self.content, "stop_type": self.stop_type, "stopping_word": self.stopping_word,
            "timings": {
                "prompt_n": self.prompt_tokens - cached, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": (self.prompt_tokens - cached) / max(prompt_ms / 1000, 1e-9),
                "predicted_n": self.tokens, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": self.tokens / max(predicted_ms / 1000, 1e-9),
            },
        }

    async def stream(self, path: str) -> AsyncIterator[bytes]:
        """A chunk per event with its text (`stop: false`), then the whole answer's fields."""
        sent, over = 0, False
        async with contextlib.aclosing(self.generation.events()) as events:
            async for _, update in events:
                if (error := failure_of(update)) is not None:
                    yield sse(error_body(path, error))
                    return
                sent = len(self.content)
                over = self.take(update)
                if over:
                    break
                if self.content[sent:]:
                    yield sse({"index": 0, "content": self.content[sent:], "tokens": update.token_ids,
                               "stop": False, "id_slot": 0})
        yield sse(self.answer(content=self.content[sent:] if over else ""))
