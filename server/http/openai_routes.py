"""OpenAI's API: /v1/models, /v1/completions, /v1/chat/completions, plain and streaming.

Responses follow OpenAI's schema field for field (plus vLLM's `stop_reason`), so the
official SDK and tools built on it (lm-eval's local-completions among them) work unchanged.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.service import GenerateService, ServiceState

from ..errors import error_body, failure_of
from ..fill_in_middle import FillInMiddle
from ..generation import Choice, Generation, adapter_of, admit, check_model, rest_of_context
from ..logprobs import TokenText, chat_logprobs, completion_logprobs, join_completion_logprobs
from ..params import check_logprobs, openai_params
from ..prompts import ChatPrompt, chat_ending, chat_prompt_of, encode, prompt_forms
from ..protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAISampling
from ..reasoning import ReplyReasoning, reasoning_fields, reasoning_parser
from ..settings import ServerSettings
from ..tool_calls import StreamedContent, Tools, choose_parser
from ..tool_calls import parse as parse_tool_calls
from .streaming import DONE, EventStream, sse, unless_disconnected

router = APIRouter()


# -- shared ---------------------------------------------------------------------------------
def prepare(request: Request, body: OpenAISampling):
    """The app's parts, after the checks every generation route makes first."""
    state = request.app.state
    admit(state.service, state.settings, body.model, [body.n])
    return state, state.service, state.settings


def include_usage(body: OpenAISampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# -- /v1/models -----------------------------------------------------------------------------
# Each model in OpenAI's fields (vLLM's root and max_model_len beside) and Anthropic's (type,
# display_name, created_at), and the list with Anthropic's paging fields, so both SDKs read them.
def model_card(state, name: str) -> dict:
    service, settings = state.service, state.settings
    max_len = service.max_seq_len if service.state is ServiceState.READY else None
    created_at = datetime.datetime.fromtimestamp(state.started_at, datetime.UTC).isoformat()
    return {"id": name, "object": "model", "created": state.started_at, "owned_by": "kiln",
            "root": settings.model_name, "max_model_len": max_len,
            "type": "model", "display_name": name, "created_at": created_at.replace("+00:00", "Z")}


def adapter_card(state, name: str) -> dict:
    """A loaded LoRA adapter as vLLM lists one: its path as `root`, the model as `parent`."""
    return model_card(state, name) | {"root": str(state.service.loras.adapters[name].path),
                                      "parent": state.settings.model_name}


def model_cards(state) -> list[dict]:
    cards = [model_card(state, name) for name in state.settings.served_model_names]
    loras = state.service.loras
    return cards + ([adapter_card(state, name) for name in loras.adapters] if loras is not None else [])


@router.get("/v1/models")
async def list_models(request: Request):
    cards = model_cards(request.app.state)
    return {"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"],
            "last_id": cards[-1]["id"]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    state = request.app.state
    check_model(state.settings, model, state.service)  # the path always names one
    return adapter_card(state, model) if adapter_of(state.service, model) else model_card(state, model)


# -- /v1/completions ------------------------------------------------------------------------
async def completion_prompts(service: GenerateService, body: CompletionRequest, settings: ServerSettings,
                             fim: FillInMiddle | None = None) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt: a string, strings, token ids, or lists of token ids;
    with `fim`, each text is the prefix of a fill-in-the-middle before the request's suffix."""
    texts, token_lists = prompt_forms(body.prompt, "prompt", settings.max_prompts)
    if texts is None:
        if fim is not None:
            raise InvalidRequestError("suffix needs the prompt as text: the prefix it is filled in after",
                                      param="suffix")
        prompts = [service.check_token_ids(p) for p in token_lists]
        return prompts, [service.decode(p, skip_special_tokens=False) for p in prompts]
    limit = settings.max_prompt_chars
    if fim is None:
        return [await encode(service, t, limit, add_special_tokens=body.add_special_tokens) for t in texts], texts
    lead = await encode(service, "", limit, add_special_tokens=body.add_special_tokens)
    suffix = await encode(service, body.suffix, limit, add_special_tokens=False, param="suffix")
    return [fim.prompt(lead, await encode(service, t, limit, add_special_tokens=False), suffix) for t in texts], texts


def fill_in_middle(service: GenerateService, body: CompletionRequest) -> FillInMiddle | None:
    """The model's fill-in-the-middle tokens where the request gives a suffix; a 400 for a model
    without them, or with echo (which would show the prompt the tokens make)."""
    if not body.suffix:
        return None
    fim = FillInMiddle.of(service.tokenizer)
    if fim is None:
        raise InvalidRequestError("suffix needs a fill-in-the-middle model (a code model whose vocabulary has "
                                  "<|fim_prefix|>, <fim_prefix> or DeepSeek-Coder's FIM tokens): this one has none",
                                  param="suffix")
    if body.echo:
        raise InvalidRequestError("echo cannot be combined with suffix", param="echo")
    return fim


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state, service, settings = prepare(request, body)
    fim = fill_in_middle(service, body)
    logprobs = check_logprobs(body.logprobs, "logprobs")
    prompts, texts = await completion_prompts(service, body, settings, fim)
    # echo with max_tokens 0 (what older lm-eval sends for loglikelihood): the prompt alone,
    # scored; one token is generated to run the prefill, and dropped.
    echo_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if echo_only else (16 if body.max_tokens is None else body.max_tokens)
    params = openai_params(body, max_tokens, logprobs, prompt_logprobs=logprobs if body.echo else None,
                           model_defaults=service.generation_defaults, lora=adapter_of(service, body.model))
    if fim is not None:  # a fill ends at the model's own end-of-fill tokens too
        params.stop_token_ids += [token for token in fim.ends if token not in params.stop_token_ids]
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    generation = await Generation(service, settings, state.metrics, prompts, [params] * len(prompts),
                                  [f"{completion_id}-{i}" for i in range(len(prompts))], body.priority).submit()
    view = CompletionView(completion_id, body.model or settings.model_name, body, prompts, texts, state.token_text,
                          echo_only, logprobs)
    if body.stream:
        return EventStream(view.stream(generation, request.url.path), on_close=generation.abort)
    results = await unless_disconnected(request, generation.collect())
    choices = []
    for i, result in enumerate(results):
        for j, choice in enumerate(result.choices):
            if (error := failure_of(choice)) is not None:
                raise error
            choices.append(view.choice(i * body.n + j, i, choice, result.prompt_logprobs))
    usage = generation.usage()
    if echo_only:
        usage.completion_tokens = 0
    return JSONResponse({**view.header("text_completion"), "choices": choices, "usage": usage.to_json()})


class CompletionView:
    """How one completions request's results are shown, whole or as stream chunks."""

    def __init__(self, completion_id: str, model: str, body: CompletionRequest, prompts: list[list[int]],
                 texts: list[str], token_text: TokenText, echo_only: bool, logprobs: int | None):
        self.id, self.model, self.body, self.prompts, self.texts = completion_id, model, body, prompts, texts
        self.token_text, self.echo_only, self.logprobs = token_text, echo_only, logprobs
        self.created = int(time.time())

    def header(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _prompt_part(self, prompt_index: int, prompt_logprobs) -> tuple[str, dict | None]:
        ids = self.prompts[prompt_index]
        scored = None
        if self.logprobs is not None:
            scored = completion_logprobs(self.token_text, ids, prompt_logprobs or [None] * len(ids))
        return self.texts[prompt_index], scored

    def choice(self, index: int, prompt_index: int, choice: Choice, prompt_logprobs) -> dict:
        text, scored = "", None
        if self.body.echo:
            text, scored = self._prompt_part(prompt_index, prompt_logprobs)
        if not self.echo_only:
            if self.logprobs is not None:
                own = completion_logprobs(self.token_text, choice.token_ids, choice.logprobs, offset=len(text))
                scored = join_completion_logprobs(scored, own) if scored else own
            text += choice.text
        finish = "length" if self.echo_only else choice.finish_reason
        return {"index": index, "text": text, "logprobs": scored, "finish_reason": finish,
                "stop_reason": None if self.echo_only else choice.stop_reason}

    async def stream(self, generation: Generation, path: str) -> AsyncIterator[bytes]:
        n = self.body.n
        offsets: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}
        events = generation.events()
        try:
            async for i, event in events:
                if (error := failure_of(event)) is not None:
                    yield sse(error_body(path, error))
                    break
                if event.prompt_logprobs is not None:
                    prompt_logprobs[i] = event.prompt_logprobs
                index = i * n + event.index
                text, scored = "", None
                if self.body.echo and index not in offsets:
                    text, scored = self._prompt_part(i, prompt_logprobs.get(i))
                if not self.echo_only:
                    if self.logprobs is not None and event.token_ids:
                        own = completion_logprobs(self.token_text, event.token_ids, event.logprobs,
                                                  offset=offsets.get(index, 0) + len(text))
                        scored = join_completion_logprobs(scored, own) if scored else own
                    text += event.text
                offsets[index] = offsets.get(index, 0) + len(text)
                finish = ("length" if self.echo_only else event.finish_reason) if event.finish_reason else None
                if not text and scored is None and finish is None:
                    continue  # a token whose text is held back (mid-character, or maybe a stop string)
                yield sse({**self.header("text_completion"), "choices": [
                    {"index": index, "text": text, "logprobs": scored, "finish_reason": finish,
                     "stop_reason": event.stop_reason if finish and not self.echo_only else None}]})
            else:
                if include_usage(self.body):
                    usage = generation.usage()
                    if self.echo_only:
                        usage.completion_tokens = 0
                    yield sse({**self.header("text_completion"), "choices": [], "usage": usage.to_json()})
        finally:
            await events.aclose()
        yield DONE


# -- /v1/chat/completions -------------------------------------------------------------------
async def chat_prompt(service: GenerateService, body: ChatCompletionRequest, settings: ServerSettings,
                      tools: Tools | None) -> ChatPrompt:
    if body.functions:
        raise InvalidRequestError("functions is OpenAI's deprecated form: pass tools", param="functions")
    kwargs, messages = dict(body.chat_template_kwargs or {}), list(body.messages)
    if tools is not None and tools.active:
        kwargs["tools"] = list(tools.declared)
        if "tools" not in chat_template_of(service, settings):  # a template that cannot show them
            messages.insert(0, ChatMessage(role="system", content=tool_instructions(tools)))
    return await chat_prompt_of(service, messages, settings.chat_template, settings.max_prompt_chars,
                                body.add_special_tokens, chat_ending(body), kwargs)


def chat_template_of(service: GenerateService, settings: ServerSettings) -> str:
    template = settings.chat_template or service.tokenizer_config.get("chat_template") or ""
    return template if isinstance(template, str) else json.dumps(template)


def tool_instructions(tools: Tools) -> str:
    """The tools as Hermes-style templates describe them, for a template with no `tools` of its own."""
    listed = "\n".join(json.dumps(tool) for tool in tools.declared)
    return ("You may call one or more functions. The functions are, as JSON schemas:\n<tools>\n" + listed +
            "\n</tools>\nTo call one, reply with <tool_call>{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}</tool_call>.")


@dataclass
class ChatRun:
    """A chat request made ready to run: its rendered prompt, sampling parameters (with the
    grammar a forced tool call or the output format needs), the tool-call format to read from the
    answer (None: the reply holds no calls), and how the reply divides into reasoning and answer."""

    prompt: ChatPrompt
    params: SamplingParams
    parser: str | None
    reasoning: ReplyReasoning


async def plan_chat(service: GenerateService, settings: ServerSettings, body: ChatCompletionRequest,
                    logprobs: int | None = None, fit_context: bool = False) -> ChatRun:
    """What /v1/chat/completions and Anthropic's /v1/messages do alike before a chat runs. The
    reply may have max_tokens, or the rest of the context where none is given; with `fit_context`
    a max_tokens past the rest of the context is cut to it (Anthropic's rule), not refused."""
    tools = Tools.of(body.tools, body.tool_choice)
    parser = choose_parser(settings.tool_call_parser, chat_template_of(service, settings))
    rendered = await chat_prompt(service, body, settings, tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None or fit_context:
        rest = rest_of_context(service, rendered.ids)
        max_tokens = rest if max_tokens is None else min(max_tokens, max(rest, 1))
    params = openai_params(body, max_tokens, logprobs, model_defaults=service.generation_defaults,
                           lora=adapter_of(service, body.model))
    forced = tools.constraint(parser) if tools is not None else None
    if forced is not None:  # tool_choice required or named: the call's grammar
        if params.constraint is not None:
            raise InvalidRequestError("tool_choice forcing a call cannot be combined with another "
                                      "structured-output constraint", param="tool_choice")
        params.constraint = forced
    reasoning = ReplyReasoning(reasoning_parser(settings.reasoning_parser), rendered.text, body.chat_template_kwargs,
                               body.include_reasoning)
    params.constraint = reasoning.constrain_answer(params.constraint)
    return ChatRun(rendered, params, parser if tools is not None and tools.active else None, reasoning)


async def submit_chat(state, run: ChatRun, request_id: str, priority: int = 0) -> Generation:
    """The chat's generation, submitted; a prompt the model cannot take is its messages' fault."""
    try:
        return await Generation(state.service, state.settings, state.metrics, [run.prompt.ids], [run.params],
                                [request_id], priority).submit()
    except InvalidRequestError as error:
        if error.param != "prompt":
            raise
        raise InvalidRequestError(error.message, param="messages") from None


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state, service, settings = prepare(request, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
    run = await plan_chat(service, settings, body, logprobs)
    parser, reasoning = run.parser, run.reasoning
    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await submit_chat(state, run, chat_id, body.priority)
    header = {"id": chat_id, "created": int(time.time()), "model": body.model or settings.model_name,
              "system_fingerprint": None}
    token_text = state.token_text
    if body.stream:
        return EventStream(stream_chat(generation, body, header, token_text, logprobs, request.url.path, parser,
                                       reasoning), on_close=generation.abort)
    [result] = await unless_disconnected(request, generation.collect())
    choices = []
    for j, choice in enumerate(result.choices):
        if (error := failure_of(choice)) is not None:
            raise error
        message, finish = {"role": "assistant", **reasoning.message_fields(choice.text)}, choice.finish_reason
        if parser is not None:  # calls are read from the answer, never from the reasoning
            content, calls = parse_tool_calls(message["content"] or "", parser)
            if calls:
                message.update(content=content, tool_calls=[c.to_json() for c in calls])
                finish = "tool_calls"
        choices.append({
            "index": j,
            "message": message,
            "logprobs": chat_logprobs(token_text, choice.logprobs) if logprobs is not None else None,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
        })
    return JSONResponse({**header, "object": "chat.completion", "choices": choices,
                         "usage": generation.usage().to_json()})


async def stream_chat(generation: Generation, body: ChatCompletionRequest, header: dict, token_text: TokenText,
                      logprobs: int | None, path: str, parser: str | None = None,
                      reasoning: ReplyReasoning | None = None) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict], **extra) -> bytes:
        return sse({**header, "object": "chat.completion.chunk", "choices": choices, **extra})

    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for j in range(body.n)])
    # With tools, text that may be a call is held back and sent as delta.tool_calls at the end.
    held = {j: StreamedContent(parser) for j in range(body.n)} if parser is not None else None
    # With a reasoning parser, each reply's thinking goes out as delta.reasoning_content.
    splitters = {j: reasoning.splitter() for j in range(body.n)} if reasoning and reasoning.parser else None
    events = generation.events()
    try:
        async for _, event in events:
            if (error := failure_of(event)) is not None:
                yield sse(error_body(path, error))
                break
            scored = chat_logprobs(token_text, event.logprobs) if logprobs is not None and event.logprobs else None
            text, finish = event.text, event.finish_reason
            delta: dict = {}
            if splitters is not None:
                thought, text = splitters[event.index].feed(text)
                if finish:
                    tail_thought, tail_text = splitters[event.index].finish()
                    thought, text = thought + tail_thought, text + tail_text
                if thought and reasoning.include_reasoning:
                    delta.update(reasoning_fields(thought))
            if held is not None:
                text = held[event.index].feed(text)
                if finish:
                    tail, calls = held[event.index].finish()
                    text += tail
                    if calls:
                        delta["tool_calls"] = [{"index": i, **call.to_json()} for i, call in enumerate(calls)]
                        finish = "tool_calls"
            if text:
                delta["content"] = text
            if not delta and scored is None and not finish:
                continue
            yield chunk([{"index": event.index, "delta": delta, "logprobs": scored, "finish_reason": finish,
                          "stop_reason": event.stop_reason if finish else None}])
        else:
            if include_usage(body):
                yield chunk([], usage=generation.usage().to_json())
    finally:
        await events.aclose()
    yield DONE

