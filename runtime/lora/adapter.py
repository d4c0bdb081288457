"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against what a build's compiled functions take (`LoraShapes`): every way an adapter can fail to
fit is an InvalidRequestError naming its path, before any slot is touched.

Each adapted module m of layer l adds scale · B @ A to its weight: y = x Wᵀ + scale · (x Aᵀ) Bᵀ, with
A [r, in], B [out, r] and scale lora_alpha / r (lora_alpha / √r with rsLoRA). The scale is folded
into B here, so the compiled functions only multiply.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidRequestError
from ..safetensors_file import SafetensorsError, read_float_tensors

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoraShapes:
    """What a build's functions take: `layers` transformer blocks, ranks up to `max_rank`, and each
    adaptable module's (in, out) features."""

    layers: int
    max_rank: int
    modules: dict[str, tuple[int, int]]


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    # (layer, module) -> (A [rank, in], scale · B [out, rank]), float32
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def _refuse(path: Path, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"the LoRA adapter at {path} {why}", param="lora_path")


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise _refuse(directory, f"has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse(directory, f"has an unreadable {CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise _refuse(directory, f"has a {CONFIG_FILE} that is not a JSON object")
    return config


def _check_config(directory: Path, config: dict, shapes: LoraShapes) -> tuple[int, float]:
    """The adapter's rank and scale, or a refusal for anything Kiln's functions cannot apply."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(directory, f"is a {config.get('peft_type')} adapter: Kiln serves LoRA adapters")
    for flag, meaning in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights (GPT-2's layout)")):
        if config.get(flag):
            raise _refuse(directory, f"uses {meaning}, which Kiln does not apply")
    if config.get("bias", "none") != "none":
        raise _refuse(directory, f"trains biases (bias: {config.get('bias')!r}): Kiln applies bias-free LoRA only")
    if config.get("modules_to_save"):
        raise _refuse(directory, f"replaces whole modules ({config['modules_to_save']}): Kiln adds LoRA deltas only")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise _refuse(directory, "gives modules ranks or alphas of their own (rank_pattern, alpha_pattern)")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(directory, f"has no positive integer rank r (got {rank!r})")
    if rank > shapes.max_rank:
        raise _refuse(directory, f"has rank {rank}, more than this server's --max-lora-rank {shapes.max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(directory, f"has a lora_alpha that is not a number ({alpha!r})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def read_adapter(name: str, directory: str | Path, shapes: LoraShapes) -> LoraAdapter:
    """The adapter in `directory`, its B scaled; InvalidRequestError for a missing file, an option
    Kiln does not apply, a rank past the build's, a module it does not adapt, or a shape that does
    not fit the model."""
    directory = Path(directory)
    if not directory.is_dir():
        raise _refuse(directory, "does not exist (a PEFT adapter is a directory)")
    rank, scale = _check_config(directory, read_config(directory), shapes)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _refuse(directory, f"has no {WEIGHTS_FILE}")
    try:
        tensors = read_float_tensors(weights_path)
    except (SafetensorsError, OSError) as error:
        raise _refuse(directory, f"has unreadable weights: {error}") from None
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _refuse(directory, f"holds {key}, which is not a LoRA A or B weight of a decoder layer")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in shapes.modules:
            adaptable = ", ".join(m for m in TARGET_MODULES if m in shapes.modules)
            raise _refuse(directory, f"adapts {module}, which this build does not (it adapts {adaptable})")
        if layer >= shapes.layers:
            raise _refuse(directory, f"adapts layer {layer}; the model has {shapes.layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise _refuse(directory, "holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(directory, f"has layer {layer}'s {module} lora_{'A' if 'A' not in pair else 'B'} missing")
        features_in, features_out = shapes.modules[module]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, features_in) or b.shape != (features_out, rank):
            raise _refuse(directory, f"has layer {layer}'s {module} as A {list(a.shape)} and B {list(b.shape)}; "
                                     f"rank {rank} over this model needs A [{rank}, {features_in}] and "
                                     f"B [{features_out}, {rank}]")
        weights[(layer, module)] = (np.ascontiguousarray(a), np.ascontiguousarray(b * scale))
    return LoraAdapter(name, directory, rank, scale, weights)
