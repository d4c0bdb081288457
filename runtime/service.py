"""GenerateService: the one object a server (or `kiln generate`) talks to.

It loads the program, sizes the KV cache, checks each request before it can
touch the device, and hands back an async iterator of Events per request. A
caller that stops iterating (a client gone) aborts its request.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from .batch import Phase
from .batcher import Batcher
from .beam_search import BeamSearch
from .config import sidecar_path
from .contract import TOKENIZER_CONFIG_FILE, Artifacts
from .decoding import DeviceSampling, PlainDecoding
from .diffusion.mode import DiffusionDecoding
from .diffusion.params import DEFAULT_CANVAS_TOKENS
from .diffusion.scheduler import DiffusionScheduler, DiffusionSchedulerConfig
from .embedding import NO_EMBED_FUNCTIONS, Embedding
from .errors import GenerationError, InvalidRequestError, ModelLoadError, NotReadyError, QueueFullError
from .executor import Executor, new_device_thread
from .finishing import Stopping
from .generation_mode import GenerationMode
from .grammar import GrammarCompiler, grammar_engine_installed
from .kvcache.events import CacheCleared, KvEventLog
from .kvcache.page_pool import PagePool
from .kvcache.plain_cache import PlainPagedAttentionCache
from .kvcache.trie_cache import TriePagedAttentionCache
from .kvcache.window_pool import WindowPagePool
from .kv_cache_size import choose_pages, device_memory
from .kv_tiers import disk_store_for, host_tier_for
from .kvcache.tiers import KvTiers
from .lora.registry import AdapterHold, LoraRegistry
from .output_processor import OutputProcessor
from .pooling import PoolingParams
from .program import Program
from .request import Event, Request
from .sampling import Sampler, SamplingParams, model_generation_defaults
from .scheduler import Scheduler, SchedulerConfig
from .service_config import ServiceConfig
from .speculative import Speculator
from .speculative.mode import SpeculativeDecoding
from .speculative.draft_model import DraftModel
from .speculative.prompt_lookup import PromptLookup

log = logging.getLogger("kiln.service")


def check_one_row_calls(abi) -> None:
    """A batch-invariant service calls prefill and decode at batch one: the export must have them."""
    if abi.is_diffusion:
        raise ModelLoadError("batch invariance runs an autoregressive model's prefill and decode a row at a time; "
                             "a diffusion model's denoising passes are not split")
    if 1 not in abi.prefill_batch_sizes or 1 not in abi.decode_batch_sizes:
        raise ModelLoadError("batch invariance calls prefill and decode at batch 1, and this export has no "
                             "such function: export it with 1 among --bs-prefill and --bs-decode")


def page_pool_for(program: Program, pages: int, release_windows: bool = True, step_tokens: int = 0) -> PagePool:
    """The KV cache's pool of `pages` pages on the program's device: a window pool (kvcache/window_pool.py)
    with the same memory for a model whose pages hold its layers by groups, whose sequences write at
    most `step_tokens` a call (0: a whole context)."""
    abi = program.capabilities
    if abi.page_groups is None:
        return PagePool(pages, program.allocate_cache)
    return WindowPagePool.sized(abi.page_groups, pages, abi.block_seq_stride, abi.max_seq_len,
                                program.allocate_cache, release_windows, step_tokens)


class ServiceState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class ServiceStats:
    state: str
    waiting_requests: int
    running_sequences: int
    running_requests: int
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_active: int
    prefix_hit_tokens: int  # not computed: found on the device, or copied back from the host or disk tier
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    steps: dict = field(default_factory=dict)
    # A diffusion LM's passes by kind, and how many passes committed each number of positions
    # (None for an autoregressive model).
    forward_passes: dict | None = None
    committed_per_pass: dict | None = None
    # Speculative decoding (None when off): its SpeculationCounters.
    speculation: object = None
    # The host KV tier (zeros when off): its pages, the hits it served, the bytes copied each way.
    host_pages_total: int = 0
    host_pages_used: int = 0
    host_hit_tokens: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    # The disk tier (zeros when off): the hits it served, its pages written, read and refused.
    disk_hit_tokens: int = 0
    disk_pages: dict = field(default_factory=dict)
    disk_pages_stored: int = 0  # page files of this model in the directory


class GenerateService:
    def __init__(self, config: ServiceConfig, prepare: Callable[[], Artifacts] | None = None,
                 program_factory: Callable[[Artifacts, str, str], Program] = Program):
        """`prepare`, if given, runs first (off the event loop) and returns the artifacts to load:
        a first-run build, during which the service is LOADING; one with a `cancel()` method is
        cancelled when the service stops before it is done. `program_factory` loads them
        (tests pass a stand-in that computes logits without a compiled model)."""
        if config.artifacts is None and prepare is None:
            raise ValueError("a ServiceConfig without artifacts needs a prepare callable")
        self.config = config
        self._prepare = prepare
        self._program_factory = program_factory
        self.state = ServiceState.LOADING
        # Loading (the devices opened, the KV caches allocated) and every executor's calls run
        # on this one thread (runtime/executor.py says why).
        self._device_thread = new_device_thread()
        self.artifacts: Artifacts | None = config.artifacts  # what was loaded (or will be)
        self.program: Program | None = None
        self.tokenizer: Tokenizer | None = None
        self.tokenizer_config: dict = {}
        self.batcher: Batcher | None = None
        self.eos_token_ids: list[int] = []
        self.vocab_size = 0
        # What a request's unset sampling fields become (SamplingParams.from_kwargs' model_defaults):
        # the model's own generation defaults, unless config.sampling_defaults says OpenAI's.
        self.generation_defaults: dict = {}
        # The most tokens a route that names no length of its own asks for (None: the rest of
        # the context).
        self.default_output_cap: int | None = None
        # What vLLM's GetModelInfo calls the model_type: "llama" for every autoregressive family
        # (they share its layout here), "diffusion" for a diffusion LM.
        self.model_type = "llama"
        # APD's autoregressive verifier (config.apd_verifier), its cache and its executor.
        self.verifier: Program | None = None
        self.verifier_cache: PlainPagedAttentionCache | None = None
        self.verifier_executor: Executor | None = None
        # Structured output's grammars for this tokenizer; None without llguidance installed.
        # They compile on threads of their own: a slow one holds up neither the event loop
        # nor the tokenizer's threads.
        self.grammars: GrammarCompiler | None = None
        self._grammar_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-grammar")
        # The prefix cache's KV events (config.kv_events), for cache-aware routers.
        self.kv_events: KvEventLog | None = None
        # The prefix cache's host-memory tier (config.host_kv_bytes) and disk tier (config.kv_cache_dir).
        self.kv_tiers: KvTiers | None = None
        # Speculative decoding's draft model (config.speculative with a draft), and its executor.
        self.draft_program: Program | None = None
        self.draft_executor: Executor | None = None
        # The generation modes' state the stats report: speculative decoding's drafter (with
        # config.speculative), a diffusion LM's mode.
        self.speculator: Speculator | None = None
        self.diffusion: DiffusionDecoding | None = None
        # A LoRA build's adapters and slots (None for a build without slots).
        self.loras: LoraRegistry | None = None

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> "GenerateService":
        """Load everything (off the event loop), then start the batcher. LOADING -> READY."""
        await asyncio.get_running_loop().run_in_executor(self._device_thread, self._load)
        self.batcher.start()
        self.state = ServiceState.READY
        return self

    def _load(self) -> None:
        if self._prepare is not None:  # it says itself whether it builds or finds a build
            self.artifacts = self._prepare()
        config, artifacts = self.config, self.artifacts
        started = time.monotonic()
        program = self._program_factory(artifacts, config.device, config.parameter_memory)
        params, abi = program.params, program.capabilities
        tokenizer_path = artifacts.tokenizer_path
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as error:
            raise ModelLoadError(f"cannot read tokenizer {tokenizer_path}: {error}") from None
        tokenizer_config_path = tokenizer_path.with_name(TOKENIZER_CONFIG_FILE)
        if tokenizer_config_path.exists():
            self.tokenizer_config = json.loads(tokenizer_config_path.read_text())
        self.vocab_size = program.kiln.vocab_size or self.tokenizer.get_vocab_size()
        self.eos_token_ids = list(program.kiln.eos_token_ids) or self._eos_from_tokenizer()
        if config.sampling_defaults == "model":
            try:
                self.generation_defaults = model_generation_defaults(
                    program.kiln.generation_defaults, f"{sidecar_path(artifacts.config)}'s generation_defaults")
            except ValueError as error:
                raise ModelLoadError(str(error)) from None
            if self.generation_defaults:
                log.info("requests that leave them unset sample with the model's defaults %s", self.generation_defaults)
        if grammar_engine_installed() and not program.capabilities.is_diffusion:
            self.grammars = GrammarCompiler(tokenizer_path.read_text(), self.vocab_size, self.eos_token_ids)

        page_bytes = program.block_elems * program.cache_dtype.itemsize
        try:
            size = choose_pages(
                page_bytes=page_bytes, export_pages=params.paged_kv_cache.device_block_count,
                pages=config.page_count, memory_bytes=config.memory_budget_bytes,
                memory_fraction=config.memory_fraction, devices=len(program.devices),
                memory=None if config.page_count or config.memory_budget_bytes else device_memory(config.device))
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
        # A host or disk tier copies a block whole: with one, a model's sliding layers keep every page.
        # What a call writes of one sequence at most: a prefill chunk, or a row and its draft.
        step = max(config.chunk_tokens, 1 + (config.speculative.num_tokens if config.speculative else 0))
        pool = page_pool_for(program, size.pages, release_windows=not (config.host_kv_bytes or config.kv_cache_dir),
                             step_tokens=step if abi.has_prefill_position else 0)
        page_count = pool.page_count
        if abi.decode_buckets and page_count != abi.fixed_page_count:
            log.info("decode calls the functions whose shapes are dynamic: the fixed-shape ones take a cache of "
                     "exactly %d pages (the export's --device-block-count), this one has %d",
                     abi.fixed_page_count, page_count)
        prefix_sharing = config.prefix_sharing
        if prefix_sharing == "trie" and not abi.has_prefill_position:
            log.warning("prefix sharing is off: this export's prefill takes no start position, "
                        "so a cached prefix cannot be skipped")
            prefix_sharing = "none"
        if abi.is_diffusion:
            prefix_sharing = "none"  # a diffusion prompt's K/V depend on the canvas after it
        if config.apd_verifier is not None:
            self._load_verifier(abi, page_count * abi.block_seq_stride)
        host_tier = None
        if config.host_kv_bytes or config.kv_cache_dir:
            # The disk tier reads into host slots: without a size given, as many as device pages.
            host_bytes = config.host_kv_bytes or size.pages * page_bytes
            host_tier = host_tier_for(config, pool, program, host_bytes, prefix_sharing)
        if config.kv_events:
            if prefix_sharing != "trie":
                raise ModelLoadError("KV events come from the prefix cache: they need --prefix-sharing trie "
                                     "(and an export whose prefill takes start positions)")
            self.kv_events = KvEventLog()
            self.kv_events.emit(CacheCleared())  # whatever a subscriber knew of an earlier run is gone
        # The scheduler covers each call's tokens before it runs: sliding pages are given as they are needed.
        cache = (TriePagedAttentionCache(pool, abi.block_seq_stride, host_tier, self.kv_events, lazy_windows=True)
                 if prefix_sharing == "trie" else PlainPagedAttentionCache(pool, abi.block_seq_stride, lazy_windows=True))
        if host_tier is not None:
            disk = disk_store_for(config, artifacts, program) if config.kv_cache_dir else None
            self.kv_tiers = KvTiers(cache, host_tier, disk)
        if config.batch_invariant:
            check_one_row_calls(abi)
        executor = Executor(program, pool.buffer, page_count, self.vocab_size, self._device_thread,
                            one_row_calls=config.batch_invariant, page_map=getattr(pool, "page_map", None))
        self.program, self.cache, self.pool = program, cache, pool
        self._load_loras(abi, executor)
        stopping = Stopping(self.tokenizer, self.eos_token_ids, abi.max_seq_len)
        scheduler, modes = self._diffusion_modes(abi, cache) if abi.is_diffusion else self._modes(abi, cache, stopping)
        # Tokens chosen where the logits lie, where the export has its sampler and it is not refused.
        device_sampling = (DeviceSampling(abi, Sampler(self.eos_token_ids))
                           if abi.sample_batch_sizes and config.device_sampling else None)
        self.batcher = Batcher(scheduler, executor, modes, stopping, OutputProcessor(self.tokenizer),
                               kv_tiers=self.kv_tiers, device_sampling=device_sampling)
        log.info(
            "loaded %s: %d KV pages of %d tokens (%.0f MiB; %s) in %.1fs",
            artifacts.vmfb, page_count, abi.block_seq_stride,
            size.pages * page_bytes / 2**20, size.reason, time.monotonic() - started,
        )
        if isinstance(pool, WindowPagePool):
            groups = pool.groups
            log.info("its sliding layers' pages %s: pages of %d layers, %d groups (%d sliding, window %d tokens)",
                     "are let go as blocks leave their window" if pool.release_windows else
                     "are all kept (a host or disk KV tier copies blocks whole)",
                     groups.layers_per_page, groups.count, sum(groups.sliding), groups.window)

    def _load_loras(self, abi, executor: Executor) -> None:
        """A LoRA build's adapter registry, its empty slots on the device, and the adapters the
        config names, read and checked (a ModelLoadError naming the one that does not fit)."""
        if not abi.lora_slots:
            if self.config.lora_adapters:
                raise ModelLoadError("LoRA adapters need a build with adapter slots: build the model with "
                                     "--max-loras N (and --max-lora-rank R)")
            return

        async def upload(arrays: list[np.ndarray]) -> None:
            def on_device() -> None:
                executor.lora_weights = [self.program.device_array(array) for array in arrays]

            await asyncio.get_running_loop().run_in_executor(self._device_thread, on_device)

        self.loras = LoraRegistry(abi, upload)
        executor.lora_weights = [self.program.device_array(array) for array in self.loras.stacked()]
        for name, path in self.config.lora_adapters.items():
            try:
                self.loras.load(name, path)
            except InvalidRequestError as error:
                raise ModelLoadError(f"--lora {name}: {error}") from None

    async def hold_adapter(self, name: str) -> AdapterHold:
        """A request's hold on the LoRA adapter `name`'s slot (placing it first if need be)."""
        if self.loras is None:
            raise InvalidRequestError("this model was built without LoRA adapter slots", param="model")
        return await self.loras.hold(name)

    async def save_prefix_to_disk(self, prompt_ids: list[int]) -> int:
        """A prompt's full pages computed (if they are not cached) and saved on disk, whatever the
        write policy (the admin route's save); returns how many of them the disk holds."""
        self.check_ready()
        if self.kv_tiers is None or self.kv_tiers.disk is None:
            raise InvalidRequestError("the server has no disk KV tier: start it with --kv-cache-dir")
        async for _ in self.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0)):
            pass
        return await self.kv_tiers.save_prefix(prompt_ids, self.batcher.wake)

    async def restore_prefix_from_disk(self, prompt_ids: list[int]) -> int:
        """A prompt's pages read from disk into the host tier ahead of use (the admin route's
        restore); returns how many of its full pages the cache now holds in any tier."""
        self.check_ready()
        if self.kv_tiers is None or self.kv_tiers.disk is None:
            raise InvalidRequestError("the server has no disk KV tier: start it with --kv-cache-dir")
        return await self.kv_tiers.restore_prefix(prompt_ids)

    async def reset_prefix_cache(self) -> int:
        """Drop every cached page no request uses (device and host tiers; the disk tier keeps its
        files), between steps: what vLLM's reset_prefix_cache and SGLang's flush_cache do.
        Returns how many cached pages went."""
        self.check_ready()
        return await self.batcher.reset_prefix_cache()

    def _load_verifier(self, abi, tokens: int) -> None:
        """APD's verifier: an autoregressive export with the same tokenizer, scoring drafts with
        its prefill (start positions, every position's logits), in a cache of its own."""
        if not abi.is_diffusion:
            raise ModelLoadError("an APD verifier goes with a diffusion model; this one is autoregressive")
        verifier = self._program_factory(self.config.apd_verifier, self.config.device, self.config.parameter_memory)
        own = verifier.capabilities
        if own.is_diffusion or not own.has_prefill_position or not own.every_position_logits:
            raise ModelLoadError("the APD verifier must be an autoregressive export whose prefill takes start "
                                 "positions and returns every position's logits (the default export)")
        if own.max_seq_len < abi.max_seq_len:
            raise ModelLoadError(f"the APD verifier's context ({own.max_seq_len}) is shorter than the model's "
                                 f"({abi.max_seq_len})")
        verifier_vocab = self._same_tokenizer(self.config.apd_verifier, "APD verifier")
        pool = page_pool_for(verifier, -(-tokens // own.block_seq_stride) + 1)
        self.verifier_cache = PlainPagedAttentionCache(pool, own.block_seq_stride)
        self.verifier_executor = Executor(verifier, pool.buffer, pool.page_count,
                                          verifier.kiln.vocab_size or verifier_vocab, self._device_thread,
                                          page_map=getattr(pool, "page_map", None))
        self.verifier = verifier

    def _same_tokenizer(self, artifacts: Artifacts, label: str) -> int:
        """ModelLoadError unless a second model's tokenizer gives every token the model's id;
        its vocabulary size otherwise."""
        try:
            other = Tokenizer.from_file(str(artifacts.tokenizer_path)).get_vocab()
        except Exception as error:
            raise ModelLoadError(f"cannot read the {label}'s tokenizer: {error}") from None
        vocab = self.tokenizer.get_vocab()
        if any(vocab.get(token) != token_id for token, token_id in other.items()):
            raise ModelLoadError(f"the {label}'s tokenizer differs from the model's: their token ids must agree")
        return len(other)

    def _modes(self, abi, cache, stopping: Stopping) -> tuple[Scheduler, list[GenerationMode]]:
        """An autoregressive model's scheduler and modes, in the order they are offered a request."""
        config = self.config
        scheduler = Scheduler(SchedulerConfig(
            prefill_batch_sizes=abi.prefill_batch_sizes,
            decode_batch_sizes=abi.decode_batch_sizes,
            block_seq_stride=abi.block_seq_stride,
            max_seq_len=abi.max_seq_len,
            chunk_tokens=config.chunk_tokens,
            prefill_token_budget=config.prefill_token_budget,
            max_running=config.max_running,
            has_prefill_position=abi.has_prefill_position,
        ), cache)
        sampler = Sampler(self.eos_token_ids)
        modes: list[GenerationMode] = [Embedding(abi), BeamSearch(scheduler, stopping)]
        if config.speculative is not None:
            self.speculator = self._speculator(abi, scheduler)
            modes.append(SpeculativeDecoding(self.speculator, sampler))
        return scheduler, modes + [PlainDecoding(sampler)]

    def _speculator(self, abi, scheduler: Scheduler) -> Speculator:
        """Speculative decoding's drafter, checked against the target export: drafts are verified
        through its decode, a row per token, so the widest decode needs a row for a draft."""
        spec = self.config.speculative
        if abi.is_diffusion:
            raise ModelLoadError("speculative decoding is for autoregressive models; this one is a diffusion LM")
        if abi.decode_batch_sizes[-1] < 2:
            raise ModelLoadError("speculative decoding verifies a draft through decode, a row per token: this "
                                 "export's widest decode has one row (export it with --bs-decode up to 2 or more)")
        if spec.method == "ngram":
            return Speculator(scheduler, spec.num_tokens, self.vocab_size, max_rows=spec.disable_by_batch_size,
                              lookup=PromptLookup(spec.prompt_lookup_max, spec.prompt_lookup_min))
        draft = self._program_factory(spec.draft, self.config.device, self.config.parameter_memory)
        tokenizer_vocab = self._same_tokenizer(spec.draft, "draft model")
        own = draft.capabilities
        if own.is_diffusion or not own.has_prefill_position:
            raise ModelLoadError("the draft model must be an autoregressive export whose prefill takes start "
                                 "positions (the default export)")
        if own.max_seq_len < abi.max_seq_len:
            raise ModelLoadError(f"the draft model's context ({own.max_seq_len}) is shorter than the model's "
                                 f"({abi.max_seq_len})")
        draft_vocab = draft.kiln.vocab_size or tokenizer_vocab
        # Room for every running sequence at full context; fewer pages only evict drafts' K/V.
        pages = min(self.pool.sequence_capacity,
                    -(-abi.max_seq_len // own.block_seq_stride) * self.config.max_running) + 1
        pool = page_pool_for(draft, pages)
        self.draft_program = draft
        self.draft_executor = Executor(draft, pool.buffer, pool.page_count, draft_vocab, self._device_thread,
                                       page_map=getattr(pool, "page_map", None))
        return Speculator(scheduler, spec.num_tokens, self.vocab_size, max_rows=spec.disable_by_batch_size,
                          draft_model=DraftModel(
            self.draft_executor, PlainPagedAttentionCache(pool, own.block_seq_stride), own.prefill_batch_sizes,
            own.decode_batch_sizes, draft_vocab))

    def _diffusion_modes(self, abi, cache) -> tuple[DiffusionScheduler, list[GenerationMode]]:
        """A diffusion LM's scheduler and its one mode."""
        scheduler = self._diffusion_scheduler(abi, cache)
        self.diffusion = DiffusionDecoding(scheduler, abi, self.verifier_executor)
        # It denoises greedily unless asked (LLaDA's and Fast-dLLM's default), and every pass
        # computes the whole canvas: without a length asked, LLaDA's, not the rest of the context.
        self.generation_defaults = {"temperature": 0.0, **self.generation_defaults}
        self.default_output_cap = DEFAULT_CANVAS_TOKENS
        self.model_type = "diffusion"
        return scheduler, [self.diffusion]

    def _diffusion_scheduler(self, abi, cache) -> DiffusionScheduler:
        config = DiffusionSchedulerConfig(
            denoise_batch_sizes=abi.denoise_batch_sizes,
            block_seq_stride=abi.block_seq_stride,
            max_running=self.config.max_running,
            mask_token_id=abi.mask_token_id,
            logits_shift=abi.logits_shift,
            has_denoise_top=abi.has_denoise_top,
        )
        verifier_sizes = self.verifier.capabilities.prefill_batch_sizes if self.verifier is not None else ()
        return DiffusionScheduler(config, cache, self.verifier_cache, verifier_sizes)

    def _eos_from_tokenizer(self) -> list[int]:
        token_id = self.special_token_id("eos_token")
        return [token_id] if token_id is not None else []

    def special_token_id(self, name: str) -> int | None:
        """The id of tokenizer_config.json's `name` token ("eos_token", "bos_token", ...), if any."""
        token = self.tokenizer_config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if token else None

    async def stop(self, grace_seconds: float = 30.0) -> None:
        """Stop taking requests, let running ones finish for up to the grace period, abort the rest."""
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)
        if self.state in (ServiceState.STOPPED, ServiceState.LOADING) or self.batcher is None:
            if self.state is ServiceState.LOADING and hasattr(self._prepare, "cancel"):
                self._prepare.cancel()  # a build would hold the process's exit until it is done
            self._device_thread.shutdown(wait=False)
            self.state = ServiceState.STOPPED
            return
        self.state = ServiceState.DRAINING
        deadline = time.monotonic() + grace_seconds
        while self.batcher.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.batcher.requests):
            self.batcher.abort(request_id)
        while self.batcher.requests and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        await self.batcher.stop()
        if self.kv_tiers is not None:  # the last step's copies made, and saved
            await self.batcher.copy_pages()
            await self.kv_tiers.close()
        self._device_thread.shutdown(wait=True)
        self.state = ServiceState.STOPPED

    # -- what callers may ask -----------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self.batcher.requests) if self.batcher is not None else 0

    @property
    def max_seq_len(self) -> int:
        return self.program.params.max_seq_len

    @property
    def context_capacity(self) -> int:
        """The most tokens (prompt + output) one sequence can hold: the context, or the whole cache if smaller."""
        return min(self.max_seq_len, self.pool.sequence_capacity * self.cache.block_seq_stride)

    def default_max_tokens(self, prompt_len: int) -> int:
        """max_tokens where a route has no default of its own: the rest of the context, at most
        default_output_cap."""
        rest = max(1, self.context_capacity - prompt_len)
        return min(rest, self.default_output_cap) if self.default_output_cap is not None else rest

    def check_ready(self) -> None:
        """NotReadyError unless the service takes requests now."""
        if self.state is ServiceState.READY:
            return
        if self.state is ServiceState.LOADING:
            raise NotReadyError("the model is still loading: retry shortly", retry_after=5)
        raise NotReadyError(f"the service is {self.state.value}, not ready", retry_after=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, so
        # a long prompt tokenized on a worker thread does not stop the event loop.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- requests ---------------------------------------------------------------------
    def check_token_ids(self, ids, param: str = "prompt") -> list[int]:
        """`ids` as a list, or InvalidRequestError naming the first id outside the vocabulary
        (checked before anything decodes them: the tokenizer overflows on huge ids). In numpy:
        a prompt may hold a million ids, and this runs on the event loop."""
        ids = list(ids)
        array = np.asarray(ids) if ids else np.zeros(0, np.int64)
        if array.dtype.kind in "iu" and array.ndim == 1:
            bad = np.flatnonzero((array < 0) | (array >= self.vocab_size))
            first = int(bad[0]) if bad.size else None
        else:  # ids numpy cannot hold as integers (too large, not numbers): find the first by hand
            first = next((i for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int)
                          or not 0 <= t < self.vocab_size), None)
        if first is not None:
            raise InvalidRequestError(f"{param}[{first}]: token id {ids[first]!r} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})", param=param)
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for anything the device must never see (cheapest checks first)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params.validate(self.vocab_size)
        footprint = self.batcher.mode_for(params).check(len(prompt_ids), params)
        total = footprint.tokens
        # An embedding generates nothing (its footprint is its prompt): it may fill the context.
        if total > self.max_seq_len or (len(prompt_ids) >= self.max_seq_len and total > len(prompt_ids)):
            # The prompt is at fault when it leaves no room for a single token; max_tokens otherwise.
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_seq_len} tokens, but {len(prompt_ids)} prompt "
                f"tokens + {total - len(prompt_ids)} generated tokens were requested",
                param="prompt" if len(prompt_ids) >= self.max_seq_len else "max_tokens",
            )
        self.check_token_ids(prompt_ids)
        if params.constraint is not None:
            self._check_constraint(params)
        if params.prompt_logprobs is not None and not self.program.capabilities.every_position_logits:
            raise InvalidRequestError("prompt logprobs need every position's logits: this export's prefill "
                                      "returns the last", param="prompt_logprobs")
        pages = self.cache.pages_for(total) * footprint.copies
        if pages > self.pool.sequence_capacity:
            raise InvalidRequestError(
                f"the request needs {pages} KV-cache pages and the cache has {self.pool.sequence_capacity}: "
                "lower max_tokens or start the server with a larger cache", param="max_tokens",
            )

    def _check_constraint(self, params: SamplingParams) -> None:
        param = params.constraint.param
        if self.grammars is None:
            raise InvalidRequestError("structured output needs the grammar engine: pip install 'kiln[structured]'",
                                      param=param)
        if params.min_tokens:
            raise InvalidRequestError("min_tokens cannot hold back the end of a structured output", param="min_tokens")
        self.grammars.compile(params.constraint)  # compiled once, checked: a 400 naming the field

    async def compile_grammars(self, params_list) -> None:
        """Compile the requests' structured-output grammars, if not cached yet, on a worker thread
        within config.grammar_compile_seconds, so the event loop goes on meanwhile (submit then
        finds them compiled); InvalidRequestError for a bad one, or one that takes too long."""
        if self.grammars is None:
            return
        for constraint in {p.constraint for p in params_list if p.constraint is not None}:
            if self.grammars.compiled(constraint):
                continue
            compiling = asyncio.get_running_loop().run_in_executor(self._grammar_threads, self.grammars.compile,
                                                                   constraint)
            try:
                await asyncio.wait_for(compiling, self.config.grammar_compile_seconds)
            except asyncio.TimeoutError:
                raise InvalidRequestError(
                    f"{constraint.param}: the grammar took more than {self.config.grammar_compile_seconds:g}s to "
                    "compile: simplify it", param=constraint.param) from None

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Event]:
        """Submit and stream Events until all n sequences finish (with params.lora's adapter held
        for it). Leaving early aborts."""
        adapter = await self.hold_adapter(params.lora) if params.lora is not None else None
        request = self.submit(prompt_ids, params, request_id, priority, adapter)
        async for event in self.stream(request):
            yield event

    def submit(self, prompt_ids, params: SamplingParams, request_id=None, priority: int = 0,
               adapter: AdapterHold | None = None) -> Request:
        """Check and submit a request; `adapter`: the LoRA adapter it runs with (its hold is let go
        when the request ends, or here if it is refused)."""
        try:
            return self._submit(prompt_ids, params, request_id, priority, adapter)
        except BaseException:
            if adapter is not None:
                adapter.release()
            raise

    def _submit(self, prompt_ids, params: SamplingParams, request_id, priority: int,
                adapter: AdapterHold | None) -> Request:
        self.check_ready()
        self.check_request(prompt_ids, params)
        if (adapter.name if adapter is not None else None) != params.lora:
            raise InvalidRequestError(f"the request names LoRA adapter {params.lora!r} but holds "
                                      f"{adapter.name if adapter is not None else 'none'}", param="model")
        if self.batcher.scheduler.waiting_count >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} requests waiting): retry later")
        request = Request(list(prompt_ids), params, request_id or uuid.uuid4().hex, priority=priority)
        if adapter is not None:
            request.lora_slot, request.cache_salt, request.on_done = adapter.slot, adapter.cache_salt, adapter.release
        if params.constraint is not None:  # before the batcher can step: each sequence its own matcher
            request.matchers = [self.grammars.matcher(params.constraint) for _ in range(params.n)]
        try:
            self.batcher.submit(request)
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        return request

    def check_embeddings(self) -> None:
        """InvalidRequestError unless the model was built with the functions embeddings call."""
        if self.program is None or not self.program.capabilities.embed_batch_sizes:
            raise InvalidRequestError(NO_EMBED_FUNCTIONS, param="model")

    def pooling(self, dimensions: int | None = None) -> PoolingParams:
        """How an embedding of this model pools (its sentence-transformers config's, or the
        server's --pooling), cut to `dimensions` where given: a Matryoshka model's sizes only."""
        spec = self.program.kiln.embedding if self.program is not None else {}
        width = self.program.capabilities.hidden_size if self.program is not None else 0
        if dimensions is not None and dimensions != width:
            sizes = spec.get("matryoshka_dimensions")
            if sizes is None:
                raise InvalidRequestError(f"this model does not support Matryoshka embeddings: dimensions must be "
                                          f"its width, {width}, or left out", param="dimensions")
            if sizes and dimensions not in sizes:
                raise InvalidRequestError(f"dimensions must be one of this model's Matryoshka sizes "
                                          f"{', '.join(map(str, sizes))}, got {dimensions}", param="dimensions")
        return PoolingParams(mode=self.config.pooling or spec.get("pooling", "last"),
                             normalize=bool(spec.get("normalize", True)),
                             dimensions=None if dimensions == width else dimensions)

    async def embed(self, prompts: list[list[int]], pooling: PoolingParams, priority: int = 0) -> list[np.ndarray]:
        """One embedding per prompt, each prompt a request of its own, batched with whatever else
        runs; every prompt is checked before any is submitted. Leaving early aborts those in flight."""
        self.check_ready()
        self.check_embeddings()
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        for ids in prompts:
            self.check_request(ids, params)
        # A long list is let in a window at a time, so it neither fills the queue nor holds back
        # the requests that arrive after it for longer than its window takes.
        window = asyncio.Semaphore(max(1, self.config.max_running))

        async def one(ids: list[int]) -> np.ndarray:
            async with window:
                async for event in self.stream(self.submit(ids, params, priority=priority)):
                    if event.finish_reason is not None and event.embedding is None:
                        raise GenerationError(f"the embedding failed: {event.error or event.finish_reason}")
                    if event.embedding is not None:
                        return event.embedding
            raise GenerationError("the embedding ended without a result")

        tasks = [asyncio.ensure_future(one(ids)) for ids in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def stream(self, request: Request) -> AsyncIterator[Event]:
        open_sequences = request.params.n
        try:
            while open_sequences:
                event = await request.events.get()
                if event.finish_reason is not None:
                    open_sequences -= 1
                yield event
        finally:
            if open_sequences:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self.batcher is not None:
            self.batcher.abort(request_id)

    def stats(self) -> ServiceStats:
        if self.batcher is None:
            return ServiceStats(self.state.value, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        cache = self.cache.stats()
        scheduler, counters = self.batcher.scheduler, self.batcher.counters
        return ServiceStats(
            state=self.state.value,
            waiting_requests=scheduler.waiting_count,
            running_sequences=len(scheduler.running),
            running_requests=len({seq.request.request_id for seq in scheduler.running}),
            pages_total=cache.total,
            pages_free=cache.free,
            pages_cached=cache.cached,
            pages_active=cache.active,
            prefix_hit_tokens=cache.hit_tokens + cache.host_hit_tokens + cache.disk_hit_tokens,
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated_tokens,
            preemptions=scheduler.preemptions,
            steps={**{phase.value: counters.steps_by_phase.get(phase.value, 0) for phase in Phase},
                   "failed": counters.failed_batches},
            forward_passes=dict(self.diffusion.counters.forward_passes) if self.diffusion is not None else None,
            committed_per_pass=dict(self.diffusion.counters.committed_per_pass) if self.diffusion is not None else None,
            speculation=self.speculator.counters if self.speculator is not None else None,
            host_pages_total=cache.host_total,
            host_pages_used=cache.host_used,
            host_hit_tokens=cache.host_hit_tokens,
            disk_hit_tokens=cache.disk_hit_tokens,
            **(self.kv_tiers.transfer_stats() if self.kv_tiers is not None else {}),
        )
