"""Request fields → the runtime's SamplingParams, with each API's defaults.

OpenAI: the model's own sampling defaults where it has them (GenerateService.generation_defaults,
as vLLM takes them), else temperature 1, top_p 1; 16 tokens for completions, the rest of the
context for chat. shortfin: 50 tokens, greedy unless top_k or top_p is given (temperature only
shapes sampling). Range checks are SamplingParams.validate's, through check_request.
"""

from __future__ import annotations

from kiln.runtime.diffusion.params import DiffusionParams
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.grammar import KINDS, Constraint
from kiln.runtime.sampling import MAX_LOGPROBS, SamplingParams

from .protocol import DiffusionFields, OpenAISampling, ShortfinSamplingParams

SHORTFIN_MAX_COMPLETION_TOKENS = 50
PARALLEL_DECODING_THRESHOLD = 0.9  # Fast-dLLM's default, what dfastllm's parallel_decoding turns on
APD_FIELDS = ("apd_mixture_weight", "apd_kv_window", "apd_max_lookahead")


def logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's map, keyed by token ids written as strings, with integer keys."""
    if not given:
        return None
    try:
        return {int(token): bias for token, bias in given.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def diffusion_params(body: DiffusionFields) -> DiffusionParams | None:
    """The request's diffusion options, aliases resolved; None when it gives none (an
    autoregressive model's generation modes refuse them, naming the field)."""
    steps = _one_of(body, "steps", "num_denoising_steps")
    threshold = _one_of(body, "threshold", "confidence_threshold")
    if body.parallel_decoding and threshold is None:
        threshold = PARALLEL_DECODING_THRESHOLD
    elif body.parallel_decoding is False and threshold is not None:
        raise InvalidRequestError("parallel_decoding false contradicts a threshold", param="parallel_decoding")
    given = {"steps": steps, "block_length": body.block_length, "remasking": body.remasking,
             "confidence": body.confidence, "threshold": threshold, "cache": body.cache, "cfg_scale": body.cfg_scale,
             **{name: getattr(body, name) for name in APD_FIELDS}}
    given = {name: value for name, value in given.items() if value is not None}
    return DiffusionParams(**given) if given else None


def _one_of(body: DiffusionFields, name: str, alias: str):
    value, other = getattr(body, name), getattr(body, alias)
    if value is not None and other is not None and value != other:
        raise InvalidRequestError(f"{name} and its alias {alias} disagree", param=alias)
    return value if value is not None else other


def format_constraint(kind: str, schema, param: str) -> Constraint | None:
    """OpenAI's output formats (chat's response_format, the Responses API's text.format) as a
    constraint: None for text; `param` is the field they came in, for errors."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.of("json_object", None, param)
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{param} json_schema needs a `schema` object", param=param)
        return Constraint.of("json", schema, param)
    raise InvalidRequestError(f"{param} type must be text, json_object or json_schema, got {kind!r}", param=param)


def openai_constraint(body: OpenAISampling) -> Constraint | None:
    """The one structured-output constraint a request asks for, in OpenAI's or vLLM's words."""
    given = []
    response_format = body.response_format
    if response_format is not None:
        schema = (response_format.json_schema or {}).get("schema")
        if (constraint := format_constraint(response_format.type, schema, "response_format")) is not None:
            given.append(constraint)
    for kind, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                       ("grammar", "guided_grammar")):
        if getattr(body, name) is not None:
            given.append(Constraint.of(kind, getattr(body, name), name))
    for kind, value in (body.structured_outputs or {}).items():
        if kind not in KINDS:
            raise InvalidRequestError(f"structured_outputs takes one of {', '.join(KINDS)}, got {kind!r}",
                                      param="structured_outputs")
        if value is not None and value is not False:
            given.append(Constraint.of(kind, value, "structured_outputs"))
    return only_one(given)


def shortfin_constraint(sp: ShortfinSamplingParams) -> Constraint | None:
    """SGLang's json_schema, regex and ebnf fields of /generate's sampling_params."""
    given = [Constraint.of(kind, getattr(sp, name), name)
             for kind, name in (("json", "json_schema"), ("regex", "regex"), ("grammar", "ebnf"))
             if getattr(sp, name) is not None]
    return only_one(given)


def only_one(given: list[Constraint]) -> Constraint | None:
    if len(given) > 1:
        raise InvalidRequestError(f"give one structured-output constraint, not {len(given)} "
                                  f"({', '.join(c.param for c in given)})", param=given[1].param)
    return given[0] if given else None


def openai_params(body: OpenAISampling, max_tokens: int, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, model_defaults: dict | None = None,
                  lora: str | None = None) -> SamplingParams:
    """`model_defaults` (the service's generation_defaults) fill the sampling fields the request
    leaves unset, before OpenAI's defaults do; `lora`: the adapter `body.model` names, if any."""
    return SamplingParams.from_kwargs(
        model_defaults=model_defaults,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        n=body.n,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        include_stop_str_in_output=body.include_stop_str_in_output,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        speculative=body.speculative,
        **openai_beam_search(body),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias(body.logit_bias),
        diffusion=diffusion_params(body),
        constraint=openai_constraint(body),
        lora=lora,
    )


def openai_beam_search(body: OpenAISampling) -> dict:
    """vLLM's beam search fields as SamplingParams': best_of beams (n when not given)."""
    if not body.use_beam_search:
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of (sampling best_of completions and returning the n best) is only "
                                      "available as a beam search: set use_beam_search", param="best_of")
        return {}
    width = body.best_of if body.best_of is not None else body.n
    if width < body.n:
        raise InvalidRequestError(f"n ({body.n}) must not exceed best_of ({width}), the beam width", param="n")
    return {"num_beams": width, "length_penalty": body.length_penalty}


def check_logprobs(value: int | None, param: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param)
    return value


def shortfin_params(sp: ShortfinSamplingParams) -> SamplingParams:
    beams = sp.num_beams if sp.num_beams is not None else 1
    if sp.use_beam_search and beams < 2:
        raise InvalidRequestError("beam search (use_beam_search) needs num_beams of 2 or more", param="num_beams")
    max_tokens = sp.max_completion_tokens if sp.max_completion_tokens is not None else sp.max_new_tokens
    sampled = sp.top_k is not None or sp.top_p is not None
    return SamplingParams.from_kwargs(
        max_tokens=SHORTFIN_MAX_COMPLETION_TOKENS if max_tokens is None else max_tokens,
        temperature=(1.0 if sp.temperature is None else sp.temperature) if sampled else 0.0,
        top_k=sp.top_k,
        top_p=sp.top_p,
        min_p=sp.min_p,
        n=sp.n if sp.n is not None else (sp.num_beams or 1),
        num_beams=beams if sp.use_beam_search else None,
        length_penalty=sp.length_penalty,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        seed=sp.seed,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        speculative=sp.speculative,
        diffusion=diffusion_params(sp),
        constraint=shortfin_constraint(sp),
    )
