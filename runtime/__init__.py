"""Kiln's runtime: a compiled model served with iree.runtime, numpy and tokenizers (no torch).

    from kiln.runtime import LLM, SamplingParams
"""

from .offline import LLM, GenerationResult
from .program import Artifacts, Program, ProgramLoadError
from .request import Completion, Event, TokenLogprob
from .sampling import SamplingParams
from .service import GenerateService, InvalidRequestError, ServiceConfig, ServiceState, ServiceUnavailableError

__all__ = [
    "LLM", "Completion", "GenerationResult", "Artifacts", "Program", "ProgramLoadError", "Event",
    "TokenLogprob", "SamplingParams", "GenerateService", "InvalidRequestError", "ServiceConfig",
    "ServiceState", "ServiceUnavailableError",
]
