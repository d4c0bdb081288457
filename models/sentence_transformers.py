"""How a model turns its hidden states into one embedding, as its sentence-transformers files say.

An embedding model on the Hub (Qwen3-Embedding, gte-Qwen2, e5-mistral) carries `modules.json`
listing its stages: the transformer, a `Pooling` stage whose `1_Pooling/config.json` names the
pooling, and often a `Normalize` stage. Kiln serves the stages it can run on the host after
the compiled function's hidden states: last-token, mean or first-token (CLS) pooling, then an
optional L2 normalisation. A model without these files pools its last token and normalises, as
vLLM does for a decoder model. A stage Kiln cannot run (a Dense projection, max pooling) is
recorded as the reason embeddings are refused, so only an `--embeddings` build fails on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.runtime.pooling import POOLING_MODES

_POOLING_FLAGS = {  # 1_Pooling/config.json's flag -> Kiln's pooling
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_TRANSFORMER, _POOLING, _NORMALIZE = (f"sentence_transformers.models.{name}" for name in
                                      ("Transformer", "Pooling", "Normalize"))


@dataclass
class EmbeddingSpec:
    pooling: str = "last"
    normalize: bool = True
    # Sizes a Matryoshka-trained model may be cut to (`dimensions`); None: only its own width.
    # An empty list: any size up to its width.
    matryoshka_dimensions: list[int] | None = None
    # Why Kiln cannot serve this model's embeddings as it defines them (None: it can).
    unsupported: str | None = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "unsupported"}


def read_embedding_spec(directory: Path, config_values: dict) -> EmbeddingSpec:
    """The directory's pooling and normalisation (modules.json and its Pooling stage's config), and
    config.json's Matryoshka sizes; the defaults where it has no sentence-transformers files."""
    spec = EmbeddingSpec(matryoshka_dimensions=_matryoshka(config_values))
    modules_path = directory / "modules.json"
    if not modules_path.exists():
        return spec
    try:
        modules = json.loads(modules_path.read_text())
        kinds = [(module["type"], module.get("path", "")) for module in modules]
    except (OSError, ValueError, TypeError, KeyError) as error:
        spec.unsupported = f"{modules_path} is not a sentence-transformers module list: {error}"
        return spec
    spec.normalize = any(kind == _NORMALIZE for kind, _ in kinds)
    others = [kind for kind, _ in kinds if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        spec.unsupported = f"its sentence-transformers stage {others[0]} is not one Kiln runs (Pooling, Normalize)"
        return spec
    pooling_path = next((path for kind, path in kinds if kind == _POOLING), None)
    if pooling_path is None:
        return spec
    try:
        flags = json.loads((directory / pooling_path / "config.json").read_text())
    except (OSError, ValueError) as error:
        spec.unsupported = f"its Pooling stage's config.json cannot be read: {error}"
        return spec
    chosen = [mode for flag, mode in _POOLING_FLAGS.items() if flags.get(flag)]
    refused = [flag for flag in _UNSUPPORTED_FLAGS if flags.get(flag)]
    if refused or len(chosen) != 1:
        named = ", ".join(refused or [flag for flag in _POOLING_FLAGS if flags.get(flag)]) or "none"
        spec.unsupported = (f"its pooling ({named}) is not one Kiln runs: exactly one of "
                            f"{', '.join(POOLING_MODES)} (last-token, mean, CLS)")
        return spec
    spec.pooling = chosen[0]
    return spec


def _matryoshka(values: dict) -> list[int] | None:
    dimensions = values.get("matryoshka_dimensions")
    if isinstance(dimensions, list) and all(isinstance(d, int) and d > 0 for d in dimensions):
        return sorted(dimensions)
    return [] if values.get("is_matryoshka") is True else None
