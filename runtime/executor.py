"""Runs a Batch on the device and returns the logits its rows need.

The call runs on one worker thread: invoke releases the GIL, so the event loop keeps
serving while the device works. What to call with which arrays is decided, and
checked, by `build_invocation`.

With `one_row_calls`, a prefill or decode batch runs as one call per row at batch one: a row's
result then cannot depend on the rows beside it, on builds whose kernels sum a row otherwise at
another batch size (IREE's matmuls tile by the call's shape), at the cost of batching.

That thread is the service's device thread (`new_device_thread`), the one that also opened
the device and allocated its KV caches: IREE's CUDA driver makes its context current only on
the thread that opened the device, and a buffer allocated from any other thread (a call's
arguments) fails with CUDA_ERROR_INVALID_CONTEXT.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .batch import Batch, Phase
from .invocation import Invocation, InvocationError, build_invocation
from .program import Program
from .sampling import SampleResult

# The phases a batch-invariant service runs a row at a time: an autoregressive request's work.
ONE_ROW_PHASES = (Phase.PREFILL, Phase.DECODE)


def new_device_thread() -> ThreadPoolExecutor:
    """A thread for everything that touches a service's devices, in order."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-device")


class Executor:
    def __init__(self, program: Program, cache_buffer, page_count: int, vocab_size: int,
                 thread: ThreadPoolExecutor, one_row_calls: bool = False, page_map: np.ndarray | None = None):
        """`thread`: the device thread the program was opened on (the service owns and closes it);
        `page_map`: a window pool's (kvcache/window_pool.py), whose pages the tables name."""
        self.program = program
        self.page_map = page_map
        self.one_row_calls = one_row_calls
        self.cache = cache_buffer
        self.page_count = page_count
        self.vocab_size = vocab_size
        self._thread = thread
        # A LoRA build's stacked adapter weights on the device (runtime/lora), passed before the
        # cache; replaced whole, between steps, when an adapter is loaded into a slot.
        self.lora_weights: list = []

    def _invoke(self, invocation: Invocation) -> list[np.ndarray | SampleResult | None]:
        arguments = (*invocation.arguments, *self.lora_weights, self.cache)
        if invocation.sample is not None:  # each row's token, chosen where the logits lie
            tokens = self.program.call_sampled(invocation.function, arguments, *invocation.sample)
            chosen = [int(tokens[at[0]]) if want else None for at, want in zip(invocation.read_at, invocation.wanted)]
            if any(token is not None and not 0 <= token < self.vocab_size for token in chosen):
                # Logits with no finite weight (NaN) leave the sampler no token to take.
                raise InvocationError(f"{invocation.sample[0]} chose no token in the vocabulary: {chosen}")
            return [None if token is None else SampleResult(token) for token in chosen]
        logits = self.program.call(invocation.function, *arguments)
        # A live view of the device's result: copy only the rows that are read.
        return [np.array(logits[at], dtype=np.float32) if want else None
                for at, want in zip(invocation.read_at, invocation.wanted)]

    async def copy_pages(self, host_tier) -> list:
        """The host tier's waiting copies (kvcache.host_tier), on the thread the model's calls
        run on, so no call is reading or writing the cache meanwhile; what its flush returns."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, host_tier.flush, self.cache.to_host())

    async def run(self, batch: Batch) -> list[np.ndarray | SampleResult | None]:
        """Logits [V] for each row that samples, [len(chunk), V] for full_logits rows and the rows of
        a speculation batch, else None; a batch with device_sampling: each sampling row's token."""
        if self.one_row_calls and batch.phase in ONE_ROW_PHASES and batch.batch_size > 1:
            logits = []
            for row in batch.one_row_batches():
                logits += await self._run(row)
            return logits
        return await self._run(batch)

    async def _run(self, batch: Batch) -> list[np.ndarray | SampleResult | None]:
        try:
            invocation = build_invocation(batch, self.program.capabilities, self.page_count, self.vocab_size,
                                          self.page_map)
        except InvocationError:
            raise
        except Exception as error:  # a scheduler bug must not take the service down
            raise InvocationError(f"could not build arguments: {error}") from error
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, self._invoke, invocation)
        except Exception as error:
            detail = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise InvocationError(f"{invocation.function} failed: {detail}") from error
