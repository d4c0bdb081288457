"""What a diffusion LM cannot do with a request's fields: a clear 400 rather than silent ignoring.

A diffusion pass commits positions anywhere in a block, so per-token penalties, logit
bias, logprobs and the truncation samplers have no position to apply to.
"""

from __future__ import annotations

from ..contract import Capabilities
from ..errors import InvalidRequestError
from ..sampling import SamplingParams
from .params import DiffusionParams, DiffusionPlan

# Field -> its value when unused: anything else is refused for a diffusion model.
_UNUSED = {
    "top_k": (-1, 0), "top_p": (1.0,), "min_p": (0.0,), "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logprobs": (None,), "prompt_logprobs": (None,),
    "min_tokens": (0,), "logit_bias": (None, {}),
}


def check_diffusion_request(params: SamplingParams, abi: Capabilities) -> DiffusionPlan:
    """Fill in the diffusion defaults, refuse what a diffusion LM cannot honour, and plan it."""
    for name, unused in _UNUSED.items():
        if getattr(params, name) not in unused:
            raise InvalidRequestError(f"{name} does not apply to a diffusion model", param=name)
    if params.diffusion is None:
        params.diffusion = DiffusionParams()
    if not isinstance(params.diffusion, DiffusionParams):
        raise InvalidRequestError("diffusion options must be DiffusionParams", param="steps")
    plan = params.diffusion.plan(params.max_tokens)
    if params.diffusion.cfg_scale and abi.denoise_batch_sizes[-1] < 2:
        raise InvalidRequestError("cfg_scale needs a denoise batch of at least 2 rows: this export's largest is 1",
                                  param="cfg_scale")
    return plan
