"""Which draft tokens a sequence keeps, from the model's logits at each drafted position.

Greedy rows keep the draft while it equals the model's argmax and then take the argmax:
exactly the tokens plain decoding gives. Sampled rows use the rejection rule of
speculative sampling (Leviathan et al., Chen et al.): draft token d, drawn from the
drafter's distribution q, is kept with probability min(1, p(d) / q(d)); the first one
refused is replaced by a draw from max(p - q, 0), renormalised; so every token follows
the model's own distribution p whatever the drafts were. Prompt lookup's q is one-hot.

Penalties, logit bias and min_tokens see the tokens kept before each position, as they
would one step at a time.
"""

from __future__ import annotations

import numpy as np

from ..sampling import SampleResult, Sampler, compute_logprobs, draw_from, probabilities


def accept(sampler: Sampler, seq, logits: np.ndarray, draft: list[int],
           draft_probs: np.ndarray | None = None) -> list[SampleResult]:
    """The tokens `seq` takes from one verify call: kept draft tokens, then the model's own.

    `logits` [len(draft) + 1, V]: row j scores the token after the last token and draft[:j].
    `draft_probs` [len(draft), V]: the distribution each draft token was drawn from; None for
    a deterministic drafter.
    """
    params = seq.params
    output = list(seq.output_ids)
    results: list[SampleResult] = []
    for j in range(len(draft) + 1):
        x = sampler.adjust(logits[j], params, output, seq.prompt_ids)
        proposed = draft[j] if j < len(draft) else None
        if params.greedy:
            token = int(np.argmax(x))
        else:
            p = probabilities(x, params)
            if proposed is None:
                token = draw_from(p, seq.rng)
            else:
                q = draft_probs[j] if draft_probs is not None else _one_hot(proposed, p.size)
                token = _accept_or_resample(p, q, proposed, seq.rng)
        results.append(_result(logits[j], token, params.logprobs))
        output.append(token)
        if token != proposed:
            break
    return results


def _accept_or_resample(p: np.ndarray, q: np.ndarray, proposed: int, rng: np.random.Generator) -> int:
    q_proposed = float(q[proposed])
    if q_proposed > 0.0 and rng.random() * q_proposed < float(p[proposed]):
        return proposed
    residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:  # p == q up to rounding: the rejection was rounding's, draw from p
        residual = p
    return draw_from(residual, rng)


def _one_hot(token: int, size: int) -> np.ndarray:
    q = np.zeros(size, np.float64)
    q[token] = 1.0
    return q


def _result(logits: np.ndarray, token: int, logprobs: int | None) -> SampleResult:
    if logprobs is None:
        return SampleResult(token)
    logprob, top = compute_logprobs(logits, token, logprobs)
    return SampleResult(token, logprob, top)
