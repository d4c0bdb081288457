"""A request's routing key: the hashes of the whole KV pages its prompt fills, chained as the
prefix cache chains them (kvcache.events.block_hash), so two requests share leading hashes
exactly when a replica could serve the second from the first's pages.

The front reads the prompt as the routes would (the chat template rendered, the tokenizer's
special tokens as each API adds them) but never refuses anything: a request it cannot read
gets no key and goes to the least loaded replica, whose app then answers it (or says what
is wrong with it) exactly as a single server would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kiln.runtime.chat import render_chat_template
from kiln.runtime.kvcache.events import chained_pages

from .prefix_table import RouteHint

CHAT_PATHS = ("/v1/chat/completions",)
COMPLETION_PATHS = ("/v1/completions",)
GENERATE_PATHS = ("/generate",)
RESPONSES_PATHS = ("/v1/responses",)
KSERVE_INFER = ("/inference.GRPCInferenceService/ModelInfer", "/inference.GRPCInferenceService/ModelStreamInfer")
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def page_hashes(token_ids: list[int], page_tokens: int) -> list[int]:
    """The chained hash of each whole page of `token_ids` (a partial last page is never shared)."""
    return [page_hash for page_hash, _, _ in chained_pages(token_ids, page_tokens)]


@dataclass(frozen=True)
class RoutingKeysSpec:
    """What a front needs to build its RoutingKeys (plain data: it crosses to the front's process)."""

    tokenizer_path: Path
    page_tokens: int
    chat_template: str | None = None
    max_chars: int = 2**20


class RoutingKeys:
    """Page hashes of the prompts a front forwards, from the model's tokenizer and chat template."""

    def __init__(self, tokenizer_path: Path, page_tokens: int, chat_template: str | None = None,
                 max_chars: int = 2**20):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        config_path = Path(tokenizer_path).with_name("tokenizer_config.json")
        self.tokenizer_config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.page_tokens = page_tokens
        self.chat_template = chat_template
        self.max_chars = max_chars

    def of_request(self, path: str, body: bytes) -> list[int]:
        """The page hashes of the request's (first) prompt; [] when there is none to read."""
        try:
            ids = self._prompt_ids(path, json.loads(body)) if body else None
        except Exception:  # anything the front cannot read, the replica's app will judge
            ids = None
        return page_hashes(ids, self.page_tokens) if ids else []

    def of_grpc(self, method: str, message: bytes) -> RouteHint:
        """A gRPC request's hint: the prompt's page hashes for KServe's inference calls and
        VllmEngine's Generate (whose request id later calls, an Abort, must follow)."""
        try:
            if method in KSERVE_INFER:
                from tritonclient.grpc import service_pb2

                request = service_pb2.ModelInferRequest.FromString(message)
                text = next((bytes(t.contents.bytes_contents[0]) for t in request.inputs
                             if t.name == "text_input" and t.contents.bytes_contents), None)
                if text is None and request.raw_input_contents:
                    index = next(i for i, t in enumerate(request.inputs) if t.name == "text_input")
                    text = request.raw_input_contents[index][4:]  # one BYTES element: its length, then it
                ids = self._encode(text.decode("utf-8", errors="replace"), True) if text is not None else None
                return RouteHint(tuple(page_hashes(ids or [], self.page_tokens)))
            if method == VLLM_GENERATE:
                from smg_grpc_proto.generated import vllm_engine_pb2

                request = vllm_engine_pb2.GenerateRequest.FromString(message)
                ids = list(request.tokenized.input_ids) if request.HasField("tokenized") else \
                    self._encode(request.text, True)
                return RouteHint(tuple(page_hashes(ids or [], self.page_tokens)), key=request.request_id or None)
        except Exception:  # the replica's service will say what is wrong with it
            pass
        return RouteHint()

    def _prompt_ids(self, path: str, request: Any) -> list[int] | None:
        if not isinstance(request, dict):
            return None
        if path in CHAT_PATHS:
            return self._chat_ids(request.get("messages"), request.get("add_generation_prompt", True),
                                  request.get("add_special_tokens", False), request.get("chat_template_kwargs"))
        if path in COMPLETION_PATHS:
            return self._prompt(request.get("prompt"), request.get("add_special_tokens", True))
        if path in GENERATE_PATHS:
            return self._prompt(request.get("input_ids") or request.get("text"), True)
        if path in RESPONSES_PATHS:
            given = request.get("input")
            messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
            if request.get("instructions") and isinstance(messages, list):
                messages = [{"role": "system", "content": request["instructions"]}, *messages]
            return self._chat_ids(messages, True, False, None)
        return None

    def _prompt(self, prompt: Any, add_special_tokens: bool) -> list[int] | None:
        """A completion prompt: text, token ids, or a list of either (the first one routes)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def _chat_ids(self, messages: Any, add_generation_prompt: bool, add_special_tokens: bool,
                  template_kwargs: Any) -> list[int] | None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        extra = template_kwargs if isinstance(template_kwargs, dict) else {}
        text = render_chat_template(self.tokenizer_config, messages, add_generation_prompt=add_generation_prompt,
                                    template=self.chat_template, **extra)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        if len(text) > self.max_chars:
            return None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
