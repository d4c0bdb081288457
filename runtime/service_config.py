"""How a GenerateService runs a model: the engine's knobs, each default declared here once.

Light on purpose (no iree, no numpy), so the CLI can show these defaults in its help
without loading the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .contract import Artifacts
from .parameters import PARAMETER_MEMORY
from .pooling import POOLING_MODES

PREFIX_SHARING = ("trie", "none")
HOST_WRITE_POLICIES = ("write_through", "write_back")  # as kvcache.host_tier names them
# Where a request's unset sampling fields come from: the model's own generation defaults where
# it has them (vLLM's and SGLang's default), or OpenAI's API defaults always.
SAMPLING_DEFAULTS = ("model", "openai")


# The share of the device's memory a default-sized KV cache leaves the process: room for the
# activations of a call and for other programs, as vLLM's default utilization leaves.
DEFAULT_MEMORY_FRACTION = 0.9

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who drafts, and how many tokens a verify call checks per row."""

    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_tokens: int = 4
    draft: Artifacts | None = None  # the draft model's export, with "draft_model"
    prompt_lookup_max: int = 4  # longest n-gram prompt lookup matches (it tries shorter ones next)
    prompt_lookup_min: int = 1
    # Speculate only while a decode batch has at most this many rows (vLLM's
    # speculative_disable_by_batch_size): the drafts share the widest decode's rows with the
    # batch, and a wider batch gains less from drafts than its extra rows cost. 0: while the
    # widest decode has a row to spare.
    disable_by_batch_size: int = 1

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if (self.draft is not None) != (self.method == "draft_model"):
            raise ValueError("a draft model's artifacts go with the draft_model method, and only with it")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_tokens}")
        if self.disable_by_batch_size < 0:
            raise ValueError(f"disable_by_batch_size must be >= 0, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max n-gram, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")


@dataclass(frozen=True)
class ServiceConfig:
    # What to load. None only while the artifacts are still to be built: GenerateService
    # is then given a `prepare` callable that builds them and returns them.
    artifacts: Artifacts | None = None
    device: str = "local-task"
    # Where the parameters live in host memory (runtime/parameters.py): "auto", "mapped" or "private".
    parameter_memory: str = "auto"
    prefix_sharing: str = "trie"  # "trie" | "none"
    # The KV cache's size: at most one of a page count, bytes, or the fraction of the device's
    # memory the process may use once the weights are loaded (runtime/kv_cache_size.py). None
    # given: the export's device_block_count, cut down where it would not fit.
    page_count: int = 0
    memory_budget_bytes: int = 0
    memory_fraction: float = 0.0
    chunk_tokens: int = 256  # longest prefill chunk per sequence (rounded down to whole pages)
    # While others stream, the most prompt tokens one prefill call takes (0: no cap): the
    # longest pause a prefill puts between their tokens.
    prefill_token_budget: int = 512
    max_running: int = 32  # sequences holding KV pages at once
    max_queue: int = 256  # requests waiting before submit answers "busy" (0: none may wait)
    # Longest a request's structured-output grammar may take to compile (off the event loop)
    # before the request is refused with a 400.
    grammar_compile_seconds: float = 20.0
    # A diffusion model's APD verifier: an autoregressive export with the same tokenizer.
    apd_verifier: Artifacts | None = None
    speculative: SpeculativeConfig | None = None  # off unless given
    # Publish the prefix cache's KV events (pages stored and evicted) for cache-aware routers.
    kv_events: bool = False
    # A host-memory tier under the prefix cache, in bytes (0: off): evicted pages are kept there.
    host_kv_bytes: int = 0
    host_kv_write_policy: str = "write_through"  # or "write_back": copy at eviction, not at publish
    # A disk tier under the host tier: pages saved in this directory outlive the server (None: off).
    kv_cache_dir: str | None = None
    sampling_defaults: str = "model"  # one of SAMPLING_DEFAULTS
    # How embeddings pool the hidden states (runtime/pooling.POOLING_MODES), in place of what the
    # model's sentence-transformers files say ("": theirs).
    pooling: str = ""
    # LoRA adapters to load at start, name -> PEFT directory, for a build with adapter slots.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # Every prefill and decode call at batch one, one row each (runtime/executor.py): a request's
    # tokens and logprobs the same whatever shares its batch, on builds whose kernels do not
    # already make them so (docs/serving.md, "Batch invariance").
    batch_invariant: bool = False
    # Choose tokens on the device through the export's sample_bs<N> (a GPU build's) wherever a
    # batch's rows allow (runtime/decoding/device_sampling.py); False: always on the host.
    device_sampling: bool = True

    def __post_init__(self):
        if self.prefix_sharing not in PREFIX_SHARING:
            raise ValueError(f"prefix_sharing must be one of {', '.join(PREFIX_SHARING)}, got {self.prefix_sharing!r}")
        if self.parameter_memory not in PARAMETER_MEMORY:
            raise ValueError(f"parameter_memory must be one of {', '.join(PARAMETER_MEMORY)}, "
                             f"got {self.parameter_memory!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, "
                             f"got {self.sampling_defaults!r}")
        if self.pooling and self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        if self.host_kv_write_policy not in HOST_WRITE_POLICIES:
            raise ValueError(f"host_kv_write_policy must be one of {', '.join(HOST_WRITE_POLICIES)}, "
                             f"got {self.host_kv_write_policy!r}")
        for name in ("page_count", "memory_budget_bytes", "prefill_token_budget", "max_queue", "host_kv_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be between 0 and 1, got {self.memory_fraction}")
        if sum(bool(size) for size in (self.page_count, self.memory_budget_bytes, self.memory_fraction)) > 1:
            raise ValueError("give the KV cache's size one way: a page count, bytes or a memory fraction")
        if self.batch_invariant and self.speculative is not None:
            raise ValueError("speculative decoding verifies several tokens of a sequence in one call: it cannot "
                             "run one row a call, so it does not go with batch_invariant")
        for name in ("chunk_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
