"""Which masked positions one forward pass commits, and to which tokens: numpy, no torch.

The rules are LLaDA's (`get_num_transfer_tokens`, `get_transfer_index`, Gumbel-max
sampling) with Fast-dLLM's threshold and Dream's confidence measures. Each function
takes only the logits of the positions it may commit ([M, V], M masked positions of the
current block), so nothing is computed for the rest of the window.
"""

from __future__ import annotations

import numpy as np


def transfer_schedule(masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` passes: as even as possible, the remainder first."""
    base, remainder = divmod(masked, steps)
    return [base + 1 if step < remainder else base for step in range(steps)]


def predict(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Each row's token: argmax, or with temperature > 0 a Gumbel-max draw in float64.

    LLaDA divides exp(logits) by (-log u)^temperature; the log of that, used here, has the
    same argmax and cannot overflow.
    """
    if temperature == 0:
        return logits.argmax(axis=-1)
    noise = -np.log(rng.random(logits.shape))  # float64, as upstream (low precision hurts quality)
    return (logits.astype(np.float64) - temperature * np.log(noise)).argmax(axis=-1)


def confidence(logits: np.ndarray, tokens: np.ndarray, measure: str) -> np.ndarray:
    """How sure the model is of each row: "top1" the chosen token's probability (LLaDA's
    low_confidence, Dream's maskgit_plus), "margin" top-1 minus top-2 probability,
    "entropy" the negative entropy of the distribution (Dream's)."""
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if measure == "top1":
        return probs[np.arange(len(tokens)), tokens]
    if measure == "margin":
        top2 = np.partition(probs, -2, axis=-1)[:, -2:] if probs.shape[-1] > 1 else np.pad(probs, ((0, 0), (1, 0)))
        return top2[:, 1] - top2[:, 0]
    if measure == "entropy":
        return (probs * np.log(probs + 1e-10)).sum(axis=-1)
    raise ValueError(f"unknown confidence measure {measure!r}")


def summary_scores(summary: np.ndarray, measure: str) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and `measure`'s scores from denoise_top's rows (token, top-1 probability,
    top-2 probability, negative entropy): what `predict` and `confidence` give at temperature 0."""
    tokens = summary[:, 0].astype(np.int64)
    top1, top2, negative_entropy = (summary[:, i].astype(np.float64) for i in (1, 2, 3))
    scores = {"top1": top1, "margin": top1 - top2, "entropy": negative_entropy}
    if measure not in scores:
        raise ValueError(f"unknown confidence measure {measure!r}")
    return tokens, scores[measure]


def choose(scores: np.ndarray, count: int | None, threshold: float | None) -> np.ndarray:
    """Indices of the rows to commit, most confident first.

    With a threshold (Fast-dLLM's parallel decoding): the most confident row always, and
    every other row whose score reaches it. Otherwise the `count` highest scores. Ties go
    to the earlier position.
    """
    order = np.argsort(-scores, kind="stable")
    if threshold is not None:
        return order[: max(1, int(np.count_nonzero(scores >= threshold)))] if len(order) else order
    return order[:count]
