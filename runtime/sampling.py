"""Turning one row of logits into the next token, on the host, with numpy.

The order follows vLLM: penalties and logit bias, then greedy or (temperature, top-k,
top-p, min-p, draw).
Logprobs come from the raw model logits, and are computed only when a request asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from .errors import InvalidRequestError, shown

if TYPE_CHECKING:
    from .diffusion.params import DiffusionParams
    from .grammar import Constraint
    from .pooling import PoolingParams

MAX_LOGPROBS = 20
# Generous bounds (OpenAI allows 4 stop strings): every stop string is compiled into one
# automaton per request, and stop token ids are checked per token.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 512  # characters
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias; each bias in [-100, 100], as OpenAI's
# Below this temperature, sampling is greedy (as vLLM's _SAMPLING_EPS): dividing by it
# would only turn the distribution into a one-hot one with worse numerics.
_GREEDY_TEMPERATURE = 1e-5
# The sampling fields a model's own generation defaults may set (its generation_config.json,
# a GGUF's general.sampling.* keys): vLLM's set. A request field left unset takes the model's
# value where it has one, else SamplingParams' own default.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_generation_defaults(values: dict[str, Any], source: str) -> dict[str, float | int]:
    """The sampling defaults a model's file gives (MODEL_DEFAULT_FIELDS' names; `values` may hold
    anything else too), each checked as a request's field would be: a value no request could
    give is refused with the file (`source`) and field named, so every request is not refused
    for it later."""
    defaults: dict[str, float | int] = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (name == "top_k" and value != int(value)):
            raise ValueError(f"{source}: {name} must be a number, got {value!r}")
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingParams(**{name: value}).validate()
        except InvalidRequestError as error:
            raise ValueError(f"{source}: {error}") from None
        defaults[name] = value
    return defaults


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the stop string that ends the text stays at its end (an end token never does).
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the chosen token's logprob and k alternatives
    # None = off; k = each prompt token's logprob (the first has none) and k alternatives.
    # The whole prompt is computed (no prefix-cache reuse): its logits at every position are needed.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # OpenAI's: token id -> a bias added to its logit before sampling (logprobs stay the model's).
    logit_bias: dict[int, float] | None = None
    # Structured output: what the text must match, enforced on the logits at every step.
    constraint: Constraint | None = None
    # Beam search when > 1: this many beams, scored by the model's log-probabilities (the
    # sampling fields do not apply); the best n come back, ranked, with their summed log-probs.
    num_beams: int = 1
    length_penalty: float = 1.0  # a beam's score: summed log-prob / length ** length_penalty
    # Whether the server's speculative decoding may draft for this request (a per-request
    # opt-out; outputs are the same either way, up to the random draws of sampling).
    speculative: bool = True
    # A diffusion LM's options: its generation mode fills in the defaults; the autoregressive
    # modes refuse them.
    diffusion: DiffusionParams | None = None
    # An embedding instead of generated text: the prompt's hidden states pooled as these say
    # (runtime/embedding); no token is sampled.
    pooling: PoolingParams | None = None
    # The LoRA adapter (by name, as loaded) the model runs with; None: the model alone.
    lora: str | None = None

    def __post_init__(self):
        # OpenAI's `stop` may be one string; None means "not given" for both lists.
        # Any other type is left as given, for validate() to refuse by name.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    @classmethod
    def from_kwargs(cls, model_defaults: dict[str, Any] | None = None, **kwargs: Any) -> "SamplingParams":
        """Build from request fields: None means "use the default", the model's own
        (`model_defaults`, from model_generation_defaults) where it has one for that field, else
        this class's; unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameters: {', '.join(unknown)}", param=unknown[0])
        given = {k: v for k, v in kwargs.items() if v is not None}
        for name, value in (model_defaults or {}).items():
            if name in MODEL_DEFAULT_FIELDS:
                given.setdefault(name, value)
        return cls(**given)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def sequence_count(self) -> int:
        """Sequences the request runs: its n completions, or its beams."""
        return max(self.n, self.num_beams)

    @property
    def has_penalties(self) -> bool:
        """Anything that changes the logits before the choice (penalties, logit bias)."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first nonsensical field; return self otherwise."""
        _integer("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0.0)
        _integer("top_k", self.top_k, low=-1)
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _number("min_p", self.min_p, low=0.0, high=1.0)
        _number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                                      param="repetition_penalty")
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _integer("seed", self.seed)
        _integer("n", self.n, low=1)
        if not isinstance(self.stop, list):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {shown(self.stop)}",
                                      param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:  # first: the checks below walk the list
            raise InvalidRequestError(f"stop has {len(self.stop)} strings: at most {MAX_STOP_STRINGS}", param="stop")
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {shown(self.stop)}",
                                      param="stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop must not contain empty strings", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequestError(f"a stop string is longer than {MAX_STOP_LENGTH} characters", param="stop")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {shown(self.stop_token_ids)}",
                                      param="stop_token_ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids has {len(self.stop_token_ids)} ids: at most "
                                      f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, low=0, high=None if vocab_size is None else vocab_size - 1)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequestError(f"include_stop_str_in_output must be a bool, got "
                                      f"{shown(self.include_stop_str_in_output)}", param="include_stop_str_in_output")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {shown(self.ignore_eos)}", param="ignore_eos")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _integer("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                      param="min_tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases",
                                          param="logit_bias")
            for token, bias in self.logit_bias.items():
                _integer("logit_bias", token, low=0, high=None if vocab_size is None else vocab_size - 1)
                _number("logit_bias", bias, low=-100.0, high=100.0)
        _integer("num_beams", self.num_beams, low=1)
        _number("length_penalty", self.length_penalty, low=-10.0, high=10.0)
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError(f"speculative must be a bool, got {shown(self.speculative)}", param="speculative")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestError(f"skip_special_tokens must be a bool, got {shown(self.skip_special_tokens)}",
                                      param="skip_special_tokens")
        return self


def _integer(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRequestError(f"{name} must be an integer, got {shown(value)}", param=name)
    _bounds(name, value, low, high)


def _number(name: str, value: Any, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidRequestError(f"{name} must be a number, got {shown(value)}", param=name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {shown(value)}", param=name)
    _bounds(name, value, low, high)


def _bounds(name: str, value: Any, low: Any, high: Any) -> None:
    if (low is None or value >= low) and (high is None or value <= high):
        return
    if low is not None and high is not None:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
    bound = f">= {low}" if low is not None else f"<= {high}"
    raise InvalidRequestError(f"{name} must be {bound}, got {value}", param=name)


def make_generator(seed: int | None = None, index: int = 0) -> np.random.Generator:
    """The per-sequence random generator: seeded ones repeat exactly, None draws fresh entropy.

    `index` tells apart the n sequences of one seeded request (index 0 is default_rng(seed)).
    """
    if seed is None:
        return np.random.default_rng()
    seed = seed % 2**64 if seed < 0 else seed
    return np.random.default_rng(seed if index == 0 else [seed, index])


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # set when params.logprobs is not None
    top_logprobs: dict[int, float] | None = None  # the params.logprobs best tokens, best first


class SamplingRow(Protocol):
    """What sample_rows needs from a sequence (runtime.request.Sequence has these)."""

    params: SamplingParams
    rng: np.random.Generator
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, output_ids: Sequence[int], prompt_ids: Sequence[int] = ()
) -> np.ndarray:
    """Repetition (HF), presence and frequency (OpenAI) penalties and the logit bias; a new
    array, or `logits` if none apply."""
    if not params.has_penalties:
        return logits
    x = np.array(logits, dtype=np.float32)
    if params.repetition_penalty != 1.0 and (len(prompt_ids) or len(output_ids)):
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))
        v = x[seen]
        x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and len(output_ids):
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        x[ids] -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        x[ids] += np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
    return x


def compute_logprobs(logits: np.ndarray, token_id: int, k: int) -> tuple[float, dict[int, float]]:
    """log_softmax(logits)[token_id] and the k most likely tokens (best first, ties by lowest id)."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x - m, dtype=np.float32).sum(dtype=np.float64)))
    top: dict[int, float] = {}
    k = min(k, x.size)
    if k > 0:
        ids = np.argpartition(x, -k)[-k:] if k < x.size else np.arange(x.size)
        ids = ids[np.lexsort((ids, -x[ids]))]
        top = {int(i): float(x[i]) - lse for i in ids}
    return float(x[token_id]) - lse, top


def compute_logprobs_rows(
    logits: np.ndarray, token_ids: Sequence[int], k: int
) -> list[tuple[float, dict[int, float]]]:
    """compute_logprobs for each row of logits [L, V] and its token: what prompt logprobs need.

    Vectorized, since a prompt chunk has hundreds of rows: one log_softmax, top-k by argpartition.
    """
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=-1)
    lse = m + np.log(np.exp(x - m[:, None], dtype=np.float32).sum(axis=-1, dtype=np.float64))
    chosen = (x[np.arange(len(x)), np.asarray(token_ids, np.int64)] - lse).tolist()
    k = min(k, x.shape[-1])
    if k <= 0:
        return [(logprob, {}) for logprob in chosen]
    best = np.argpartition(x, -k, axis=-1)[:, -k:] if k < x.shape[-1] else np.broadcast_to(np.arange(k), x.shape)
    out = []
    for row, logprob in enumerate(chosen):
        ids = best[row]
        ids = ids[np.lexsort((ids, -x[row, ids]))]  # best first, ties by lowest id
        out.append((logprob, {int(i): float(x[row, i]) - float(lse[row]) for i in ids}))
    return out


class Sampler:
    """Chooses next tokens; knows the model's EOS ids so min_tokens can hold them back."""

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = [int(t) for t in eos_token_ids]

    def sample(
        self,
        logits: np.ndarray,
        params: SamplingParams,
        rng: np.random.Generator,
        output_ids: Sequence[int] = (),
        prompt_ids: Sequence[int] = (),
    ) -> SampleResult:
        """One token from a float32 row [V] of raw logits."""
        x = self.adjust(logits, params, output_ids, prompt_ids)
        token = int(np.argmax(x)) if params.greedy else _draw(x, params, rng)
        if params.logprobs is None:
            return SampleResult(token)
        logprob, top = compute_logprobs(logits, token, params.logprobs)
        return SampleResult(token, logprob, top)

    def adjust(self, logits: np.ndarray, params: SamplingParams, output_ids: Sequence[int] = (),
               prompt_ids: Sequence[int] = ()) -> np.ndarray:
        """The logits a choice is made from: penalties, logit bias, and the tokens min_tokens
        holds back set to -inf; `logits` itself when none apply."""
        x = apply_penalties(logits, params, output_ids, prompt_ids)
        banned = self._banned(params, len(output_ids))
        if banned:
            if x is logits:
                x = np.array(logits, dtype=np.float32)
            x[banned] = -np.inf
        return x

    def sample_rows(self, logits: Sequence[np.ndarray], rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """One token for each row: logits[i], a float32 row [V], sampled for rows[i]."""
        results = []
        for x, row in zip(logits, rows):
            matcher = getattr(row, "matcher", None)
            if matcher is not None:  # structured output: only what the grammar allows next
                x = matcher.mask_logits(x)
            if self._plain_greedy(row):  # the common case: one argmax, no copies
                results.append(SampleResult(int(np.argmax(x))))
            else:
                results.append(self.sample(x, row.params, row.rng, row.output_ids, row.prompt_ids))
            if matcher is not None:
                matcher.accept(results[-1].token_id)
        return results

    def device_settings(self, row: SamplingRow) -> tuple[float, int, float, float] | None:
        """(temperature, top_k, top_p, min_p) for the compiled sampler (export/device_sampling.py),
        temperature 0 when greedy; None for a row only the host can sample: one with logprobs,
        penalties or bias, a grammar, or tokens held back by min_tokens."""
        p = row.params
        if (p.logprobs is not None or p.has_penalties or getattr(row, "matcher", None) is not None
                or self._banned(p, len(row.output_ids))):
            return None
        if p.greedy:
            return 0.0, 0, 1.0, 0.0
        return p.temperature, p.top_k, p.top_p, p.min_p

    def _plain_greedy(self, row: SamplingRow) -> bool:
        p = row.params
        return (p.greedy and p.logprobs is None and not p.has_penalties
                and (p.min_tokens == 0 or not self._banned(p, len(row.output_ids))))

    def _banned(self, params: SamplingParams, generated: int) -> list[int]:
        if generated >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else self.eos_token_ids
        return eos + params.stop_token_ids


def _draw(x: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Temperature, top-k, top-p, min-p, then one draw by inverse CDF (one random number)."""
    ids, p = _candidates(x, params)
    if p is None:  # everything banned: nothing sensible to draw
        return int(ids[0]) if ids is not None else 0
    j = _inverse_cdf(p, rng.random())
    return int(ids[j]) if ids is not None else j


def probabilities(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `_draw` samples from, as a float64 vector over the whole vocabulary:
    what speculative decoding's acceptance rule compares (one-hot when greedy)."""
    out = np.zeros(x.size, np.float64)
    if params.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
    ids, p = _candidates(x, params)
    if p is None:
        out[int(ids[0]) if ids is not None else 0] = 1.0
        return out
    p = p.astype(np.float64) / float(p.sum(dtype=np.float64))
    if ids is None:
        return p
    out[ids] = p
    return out


def draw_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability p[i] / sum(p) (p non-negative, not all zero)."""
    return _inverse_cdf(p, rng.random())


def _candidates(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(Candidate token ids in order of id, or None for the whole vocabulary; their unnormalised
    weights after temperature, top-k, top-p and min-p), weights None when all are banned."""
    ids: np.ndarray | None = None
    k = params.top_k
    if 0 < k < x.size:
        # In order of id, the order the draw walks, as the compiled sampler's
        # (export/device_sampling.py): both take the same token for the same number.
        ids = np.sort(np.argpartition(x, -k)[-k:])
        x = x[ids]
    # float32 throughout: numpy's float64 exp is an order of magnitude slower.
    p = np.divide(x, params.temperature, dtype=np.float32)
    top = p.max()
    if top == -np.inf:
        return ids, None
    p -= top
    np.exp(p, out=p)  # unnormalised weights; the best candidate has weight 1
    if params.top_p < 1.0:
        nucleus = _nucleus(p, params.top_p)
        p = p[nucleus]
        ids = nucleus if ids is None else ids[nucleus]
    if params.min_p > 0.0:
        # min_p * max_prob does not depend on normalisation, and the best weight is 1.
        kept = np.flatnonzero(p >= params.min_p)
        p = p[kept]
        ids = kept if ids is None else ids[kept]
    return ids, p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest most-likely set whose mass reaches top_p, in increasing order."""
    target = top_p * float(p.sum(dtype=np.float64))
    order = None
    # The nucleus is a prefix of the descending order: when the best m weights already
    # reach the target, sorting those m is enough (a full sort of 50k costs milliseconds).
    for m in (256, 4096):
        if p.size > 4 * m:
            best = np.argpartition(p, -m)[-m:]
            if p[best].sum() >= target:
                order = best[np.lexsort((best, -p[best]))]
                break
    if order is None:
        order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order], dtype=np.float64), target, side="left")) + 1
    return np.sort(order[:keep])


_BLOCK = 256


def _inverse_cdf(w: np.ndarray, u: float) -> int:
    """An index drawn with probability w[i] / sum(w), for u uniform in [0, 1).

    Two levels (block sums, then one block) because a cumsum over 50k weights is slow.
    """
    if w.size <= 4 * _BLOCK:
        return _search(w, u * w.sum())[0]
    full = w.size - w.size % _BLOCK
    sums = w[:full].reshape(-1, _BLOCK).sum(axis=1)
    if full < w.size:
        sums = np.append(sums, w[full:].sum())
    b, rest = _search(sums, u * sums.sum())
    return b * _BLOCK + _search(w[b * _BLOCK : (b + 1) * _BLOCK], rest)[0]


def _search(w: np.ndarray, target: float) -> tuple[int, float]:
    """(First i whose running sum exceeds target, what is left of target inside w[i]).

    Never an index of weight 0, even when rounding puts target past the total.
    """
    cum = np.cumsum(w)
    i = int(np.searchsorted(cum, target, side="right"))
    if i >= w.size or w[i] <= 0:
        i = int(np.flatnonzero(w > 0)[-1])
        return i, float(w[i]) * 0.5
    return i, float(target - (cum[i - 1] if i else 0.0))
