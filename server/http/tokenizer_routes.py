"""vLLM's tokenizer routes: /tokenize, /detokenize, /tokenizer_info.

Clients that count or build prompts themselves (lm-eval's remote tokenizer among them)
use these instead of loading the tokenizer, so they need no tokenizer path of their own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kiln.runtime.errors import InvalidRequestError

from ..generation import admit
from ..prompts import chat_ending, chat_ids, encode
from ..protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()

# tokenizer_config.json fields a client may use to rebuild the tokenizer's behaviour.
_INFO_FIELDS = ("tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token",
                "add_eos_token", "clean_up_tokenization_spaces", "model_max_length")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = request.app.state
    service, settings = state.service, state.settings
    admit(service, settings, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages")
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)  # a chat template writes its own special tokens
        ids = await chat_ids(service, body.messages, settings.chat_template, settings.max_prompt_chars, add_special,
                             chat_ending(body), body.chat_template_kwargs)
    else:
        ids = await encode(service, body.prompt, settings.max_prompt_chars,
                           add_special_tokens=body.add_special_tokens is not False)
    strings = [service.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": service.max_seq_len, "tokens": ids, "token_strs": strings}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = request.app.state
    service = state.service
    admit(service, state.settings, body.model)
    ids = service.check_token_ids(body.tokens, param="tokens")
    return {"prompt": service.decode(ids, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    state = request.app.state
    service = state.service
    service.check_ready()
    config = service.tokenizer_config
    info = {name: config[name] for name in _INFO_FIELDS if name in config}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["chat_template"] = state.settings.chat_template or config.get("chat_template")
    info["vocab_size"] = service.vocab_size
    info["max_model_len"] = service.max_seq_len
    return info
