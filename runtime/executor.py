"""Runs a Batch on the device: i64 argument arrays, checks, the call, the logits it needs.

The compiled code checks nothing (a bad page id is an unchecked write, a token
length off the stride crashes the process), so every argument is validated here
against the ABI before the call. The call runs on one worker thread: invoke
releases the GIL, so the event loop keeps serving while the device works.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .program import Program
from .scheduler import Batch


class InvocationError(Exception):
    """A batch that could not be run; its sequences fail, the service goes on."""


class Executor:
    def __init__(self, program: Program, cache_buffer, page_count: int, vocab_size: int):
        self.program = program
        self.cache = cache_buffer
        self.page_count = page_count
        self.vocab_size = vocab_size
        self.stride = program.params.block_seq_stride
        self.max_seq_len = program.params.max_seq_len
        self.has_prefill_position = program.params.has_prefill_position
        self.final_logits_only = program.kiln.prefill_final_logits
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-device")

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    # -- arguments --------------------------------------------------------------------
    def build_arguments(self, batch: Batch) -> tuple[str, list[np.ndarray], list[int]]:
        """Function name, argument arrays, and for each row the logits position to read."""
        rows, stride = batch.batch_size, self.stride
        width = max(len(c) for c in batch.chunks)
        t = -(-width // stride) * stride if batch.kind == "prefill" else 1
        tokens = np.zeros((rows, t), np.int64)
        starts = np.zeros(rows, np.int64)
        seq_lens = np.ones(rows, np.int64)  # padded rows: length 1 on page 0
        read_at: list[int | slice] = []
        full = batch.full_logits or [False] * len(batch.chunks)
        name = f"{batch.kind}_bs{rows}"
        last_only = self.final_logits_only
        if batch.kind == "prefill" and not last_only and not any(full) and f"prefill_last_bs{rows}" in self.program.functions:
            name, last_only = f"prefill_last_bs{rows}", True  # skips the [N, T, V] projection
        for row, (start, chunk) in enumerate(zip(batch.starts, batch.chunks)):
            tokens[row, : len(chunk)] = chunk
            starts[row] = start
            seq_lens[row] = start + len(chunk)
            if batch.kind == "decode" or last_only:
                read_at.append(0)
            else:  # every position of the chunk for prompt logprobs, else its last
                read_at.append(slice(0, len(chunk)) if full[row] else len(chunk) - 1)
        blocks = -(-int(seq_lens.max()) // stride)
        table = np.zeros((rows, blocks), np.int64)
        for row, seq in enumerate(batch.seqs):
            pages = seq.allocation.pages[:blocks]
            table[row, : len(pages)] = pages
        self.validate(batch, tokens, seq_lens, table)
        if batch.kind == "decode":
            return name, [tokens, seq_lens, starts, table], read_at
        if self.has_prefill_position:
            return name, [tokens, starts, seq_lens, table], read_at
        return name, [tokens, seq_lens, table], read_at

    def validate(self, batch: Batch, tokens, seq_lens, table) -> None:
        if batch.kind not in ("prefill", "decode"):
            raise InvocationError(f"unknown batch kind {batch.kind}")
        if len(batch.seqs) > batch.batch_size:
            raise InvocationError(f"{len(batch.seqs)} rows for a batch of {batch.batch_size}")
        if batch.kind == "prefill" and tokens.shape[1] % self.stride:
            raise InvocationError(f"prefill length {tokens.shape[1]} is not a multiple of {self.stride}")
        if any(batch.full_logits) and (batch.kind != "prefill" or self.final_logits_only):
            raise InvocationError("logits at every position need a prefill that returns them all")
        if not self.has_prefill_position and batch.kind == "prefill" and any(batch.starts):
            raise InvocationError("this export's prefill takes no start position")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise InvocationError("a token id is outside the vocabulary")
        if seq_lens.max() > self.max_seq_len or tokens.shape[1] > self.max_seq_len:
            raise InvocationError(f"a sequence is longer than max_seq_len {self.max_seq_len}")
        if table.min() < 0 or table.max() >= self.page_count:
            raise InvocationError("a page id is outside the cache")
        for row, seq in enumerate(batch.seqs):
            needed = -(-int(seq_lens[row]) // self.stride)
            if np.count_nonzero(table[row, :needed]) != needed:
                raise InvocationError(f"sequence {seq.request.request_id} lacks pages for {seq_lens[row]} tokens")

    # -- the call ---------------------------------------------------------------------
    def _invoke(self, name: str, args: list[np.ndarray], read_at: list[int | slice], wanted: list[bool]) -> list:
        result = self.program.functions[name](*args, self.cache)
        if isinstance(result, tuple):
            raise InvocationError("top-k exports are not served yet: export without --top-k")
        logits = result.to_host()  # a live view: copy only the rows we need
        return [np.array(logits[row, at], dtype=np.float32) if want else None
                for row, (at, want) in enumerate(zip(read_at, wanted))]

    async def run(self, batch: Batch) -> list[np.ndarray | None]:
        """Logits [V] for each row that samples, [len(chunk), V] for full_logits rows, else None."""
        try:
            name, args, read_at = self.build_arguments(batch)
        except InvocationError:
            raise
        except Exception as error:  # a scheduler bug must not take the service down
            raise InvocationError(f"could not build arguments: {error}") from error
        loop = asyncio.get_running_loop()
        try:
            full = batch.full_logits or [False] * len(batch.samples)
            wanted = [samples or whole for samples, whole in zip(batch.samples, full)]
            return await loop.run_in_executor(self._thread, self._invoke, name, args, read_at, wanted)
        except InvocationError:
            raise
        except Exception as error:
            raise InvocationError(f"{name} failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from error
