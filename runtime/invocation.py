"""A Batch as the ABI's argument arrays, checked: a pure function, no device needed.

The compiled code checks nothing (a bad page id is an unchecked write, a token length
off the stride crashes the process), so every argument is validated here against the
contract before any call is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch, Phase
from .contract import Capabilities, FunctionKind, argument_names, function_name
from .errors import GenerationError


class InvocationError(GenerationError):
    """A batch that could not be run; its sequences fail, the service goes on."""


@dataclass(frozen=True)
class Invocation:
    function: str
    arguments: tuple[np.ndarray, ...]  # in the contract's order, all but the cache
    # For each row of the batch: where its logits lie in the result, (call rows, positions).
    read_at: tuple[tuple[int | slice, int | slice], ...]
    wanted: tuple[bool, ...]  # rows whose logits are read at all
    # The compiled sampler to call on the result where it lies, and its arrays (the batch's
    # device_sampling): each row's token id comes back instead of its logits. None: logits.
    sample: tuple[str, tuple[np.ndarray, ...]] | None = None


def build_invocation(batch: Batch, abi: Capabilities, page_count: int, vocab_size: int,
                     page_map: np.ndarray | None = None) -> Invocation:
    """The function to call and its arguments; InvocationError for anything off the contract."""
    if batch.phase is Phase.SPECULATE:
        return _speculation_as_decode(batch, abi, page_count, vocab_size, page_map)
    rows, stride = batch.batch_size, abi.block_seq_stride
    if batch.rows > rows or not batch.rows:
        raise InvocationError(f"{batch.rows} rows for a batch of {rows}")
    if batch.phase is Phase.DECODE:
        if any(len(chunk) != 1 for chunk in batch.tokens):
            raise InvocationError("a decode row feeds exactly one token")
        # The function (a fixed-shape bucket or decode_bs<N>) depends on the rows' lengths, below.
        name, last_only, kind = "", True, FunctionKind.DECODE
        width = 1
    elif batch.phase is Phase.DENOISE:
        if rows not in abi.denoise_batch_sizes:
            raise InvocationError(f"this export has no denoise function for a batch of {rows}")
        kind = FunctionKind.DENOISE if any(batch.full_logits) else FunctionKind.DENOISE_TOP
        if kind is FunctionKind.DENOISE_TOP and not abi.has_denoise_top:
            raise InvocationError("this export has no denoise_top function: every row needs full logits")
        name, last_only = function_name(kind, rows), False
        width = max(len(chunk) for chunk in batch.tokens)
        # A row shorter than the call is padded at its end: harmless only where the padding
        # lies past what the row attends to (written to page 0), never over cached K/V.
        for start, chunk, visible in zip(batch.starts, batch.tokens, batch.seq_lens):
            if len(chunk) < width and start + len(chunk) < visible:
                raise InvocationError("a denoise window that attends past its end cannot be padded")
    elif batch.phase is Phase.EMBED:
        if rows not in abi.embed_batch_sizes:
            raise InvocationError(f"this export has no embed function for a batch of {rows}")
        if not abi.has_prefill_position and any(batch.starts):
            raise InvocationError("this export's prefill takes no start position")
        name, last_only, kind = function_name(FunctionKind.EMBED, rows), False, FunctionKind.EMBED
        width = -(-max(len(chunk) for chunk in batch.tokens) // stride) * stride
    else:
        every_position = any(batch.full_logits)
        if every_position and not abi.every_position_logits:
            raise InvocationError("logits at every position need a prefill that returns them all")
        if not abi.has_prefill_position and any(batch.starts):
            raise InvocationError("this export's prefill takes no start position")
        name, last_only = abi.prefill_function(rows, every_position)
        kind = FunctionKind.PREFILL
        width = -(-max(len(chunk) for chunk in batch.tokens) // stride) * stride
    if any(batch.full_logits) and batch.phase is Phase.DECODE:
        raise InvocationError("logits at every position need a prefill")
    if batch.visible and (len(batch.visible) != batch.rows or batch.phase is not Phase.DENOISE):
        raise InvocationError("only a denoise batch attends past its tokens, one bound per row")

    tokens = np.zeros((rows, width), np.int64)
    starts = np.zeros(rows, np.int64)
    seq_lens = np.ones(rows, np.int64)  # padding rows: one token on page 0
    for row, (start, chunk, seq_len) in enumerate(zip(batch.starts, batch.tokens, batch.seq_lens)):
        tokens[row, : len(chunk)] = chunk
        starts[row] = start
        seq_lens[row] = seq_len
    if kind is FunctionKind.DECODE:
        name, blocks = abi.decode_function(rows, int(seq_lens.max()), page_count)
    else:
        blocks = -(-int(seq_lens.max()) // stride)
    table = np.zeros((rows, blocks), np.int64)
    for row, pages in enumerate(batch.block_tables):
        pages = pages[:blocks]
        table[row, : len(pages)] = pages
    _validate(batch, abi, page_count, vocab_size, tokens, seq_lens, table)
    if page_map is not None:  # each block's page in every group (kvcache/window_pool.py): [rows, groups, blocks]
        table = np.ascontiguousarray(page_map[table].transpose(0, 2, 1))

    read_at: list[tuple[int, int | slice]] = []
    for row, (chunk, full) in enumerate(zip(batch.tokens, batch.full_logits)):
        if batch.phase is Phase.DENOISE:  # logits or summaries, every position of the window
            read_at.append((row, slice(0, len(chunk))))
        elif last_only:
            read_at.append((row, 0))
        else:  # every position of the chunk for prompt logprobs, else its last
            read_at.append((row, slice(0, len(chunk)) if full else len(chunk) - 1))
    wanted = tuple(samples or full for samples, full in zip(batch.samples, batch.full_logits))
    sample = _sample_call(batch, abi, last_only) if batch.device_sampling else None
    lora_slots = np.zeros(rows, np.int64)
    lora_slots[: len(batch.lora_slots)] = batch.lora_slots
    if lora_slots.min() < 0 or lora_slots.max() > abi.lora_slots:
        raise InvocationError(f"a LoRA slot is outside this build's 0..{abi.lora_slots}")
    named = {"tokens": tokens, "start_pos": starts, "start_positions": starts, "seq_lens": seq_lens,
             "seq_block_ids": table, "lora_slots": lora_slots}
    # The stacked adapter weights and the cache are the executor's, passed after these.
    arguments = tuple(named[arg] for arg in argument_names(kind, abi.has_prefill_position, bool(abi.lora_slots))
                      if arg not in ("lora_weights", "cache"))
    return Invocation(name, arguments, tuple(read_at), wanted, sample)


def _sample_call(batch: Batch, abi: Capabilities, last_only: bool) -> tuple[str, tuple[np.ndarray, ...]]:
    """sample_bs<N> and its arrays for a batch whose rows the compiled sampler chooses; padding rows
    are greedy."""
    rows = batch.batch_size
    if not last_only or rows not in abi.sample_batch_sizes or len(batch.device_sampling) != batch.rows:
        raise InvocationError(f"this export cannot sample a {batch.phase.value} batch of {rows} on the device")
    temperature, top_k, min_p, uniform = (np.zeros(rows, np.float32), np.zeros(rows, np.int64),
                                          np.zeros(rows, np.float32), np.zeros(rows, np.float32))
    top_p = np.ones(rows, np.float32)
    for row, settings in enumerate(batch.device_sampling):
        temperature[row], top_k[row], top_p[row], min_p[row], uniform[row] = settings
    return function_name(FunctionKind.SAMPLE, rows), (temperature, top_k, top_p, min_p, uniform)


def _speculation_as_decode(batch: Batch, abi: Capabilities, page_count: int, vocab_size: int,
                           page_map: np.ndarray | None = None) -> Invocation:
    """A speculation batch (each row its last token and its draft) as one decode call with a row
    per token: the row for a draft's i-th token sits at its own position and attends to the
    tokens before it, whose K/V the rows before it write in the same call (decode writes every
    row's K/V before any row attends). So each token's logits are what plain decoding would
    compute one step at a time, through the same kernels, whose results for a row do not depend
    on the rows beside it; a prefill over the draft would run other kernels and round otherwise."""
    rows: list[tuple] = []  # (sequence, start, token, table, adapter slot) per call row
    read_at = []
    slots = batch.lora_slots or (0,) * batch.rows
    for seq_id, start, chunk, table, slot in zip(batch.seq_ids, batch.starts, batch.tokens, batch.block_tables,
                                                 slots):
        read_at.append((slice(len(rows), len(rows) + len(chunk)), 0))
        rows += [(seq_id, start + i, (token,), table, slot) for i, token in enumerate(chunk)]
    if len(rows) > batch.batch_size:
        raise InvocationError(f"a speculation batch of {len(rows)} tokens for a decode of {batch.batch_size} rows")
    seq_ids, starts, tokens, tables, row_slots = zip(*rows)
    decode = Batch(Phase.DECODE, batch.batch_size, seq_ids, starts, tokens, tables, (True,) * len(rows),
                   (False,) * len(rows), lora_slots=row_slots)
    call = build_invocation(decode, abi, page_count, vocab_size, page_map)
    wanted = tuple(samples or full for samples, full in zip(batch.samples, batch.full_logits))
    return Invocation(call.function, call.arguments, tuple(read_at), wanted)


def _validate(batch: Batch, abi: Capabilities, page_count: int, vocab_size: int, tokens, seq_lens, table) -> None:
    if not all(len(c) for c in batch.tokens):
        raise InvocationError("a row feeds no token")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise InvocationError("a token id is outside the vocabulary")
    if seq_lens.max() > abi.max_seq_len or tokens.shape[1] > abi.max_seq_len:
        raise InvocationError(f"a sequence is longer than max_seq_len {abi.max_seq_len}")
    if table.min() < 0 or table.max() >= page_count:
        raise InvocationError("a page id is outside the cache")
    for row, seq_id in enumerate(batch.seq_ids):
        needed = -(-int(seq_lens[row]) // abi.block_seq_stride)
        if np.count_nonzero(table[row, :needed]) != needed:
            raise InvocationError(f"sequence {seq_id} lacks pages for {seq_lens[row]} tokens")
