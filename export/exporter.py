"""Trace a PagedLlama into one MLIR module of prefill_bs<N> / decode_bs<N> functions.

The functions follow shortfin's ABI (DESIGN.md). Token length, block count and
the cache's page count are dynamic, so one VMFB serves any prompt length up to
max_seq_len and any cache size the runtime chooses.
"""

from __future__ import annotations

import torch
from iree.turbine import aot
from torch.export import Dim

from kiln.models.llama import PagedLlama

from .options import ExportOptions

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_logits(model: PagedLlama, options: ExportOptions, h, start_pos, seq_lens, final_only=None):
    """Turn hidden states into what the function returns: logits, or top-k values and ids.

    `final_only` (default: the export's prefill_final_logits) keeps only each row's last
    real position, skipping the [N, T, V] projection a sampler never reads.
    """
    final_only = options.prefill_final_logits if final_only is None else final_only
    if final_only and h.shape[1] != 1:
        last = torch.clamp(seq_lens - 1 - start_pos, min=0, max=h.shape[1] - 1)
        h = torch.gather(h, 1, last.view(-1, 1, 1).expand(-1, 1, h.shape[2]))
    logits = model.logits(h)
    if options.logits_normalization == "softmax":
        logits = torch.softmax(logits, dim=-1)
    elif options.logits_normalization == "log_softmax":
        logits = torch.log_softmax(logits, dim=-1)
    if options.top_k is None:
        return logits
    if options.top_k == 1:
        values, indices = torch.max(logits, dim=-1, keepdim=True)
        return values, indices
    return torch.topk(logits, options.top_k, dim=-1)


def trace_module(model: PagedLlama, options: ExportOptions, log=print) -> aot.ExportOutput:
    """Export every requested function of `model` into one module."""
    import time

    stride = options.block_seq_stride
    max_blocks = options.max_seq_len // stride
    cache_dtype = TORCH_DTYPES[options.cache_dtype]
    example_pages = max(options.device_block_count, 4)
    fxb = aot.FxProgramsBuilder(model)

    prefill_kinds = [("prefill", options.prefill_final_logits)]
    if options.prefill_last_functions and not options.prefill_final_logits:
        prefill_kinds.append(("prefill_last", True))
    for (kind, final_only), bs in ((k, bs) for k in prefill_kinds for bs in options.prefill_batch_sizes):
        started = time.monotonic()
        token_blocks = Dim("token_blocks", min=1, max=max_blocks)
        blocks = Dim("blocks", min=1, max=max_blocks)
        pages = Dim("pages", min=2)
        # The example shapes must differ from one another and from 1, or export
        # specializes them as equal.
        tokens = torch.zeros(bs, 2 * stride, dtype=torch.int64)
        start_pos = torch.zeros(bs, dtype=torch.int64)
        seq_lens = torch.ones(bs, dtype=torch.int64)
        seq_block_ids = torch.zeros(bs, 3, dtype=torch.int64)
        cache = model.allocate_cache(example_pages, cache_dtype)
        tokens_dims = {1: token_blocks * stride}
        shapes = {"tokens": tokens_dims, "seq_lens": {}, "seq_block_ids": {1: blocks}, "cache": {0: pages}}

        if options.has_prefill_position:
            shapes["start_pos"] = {}

            @fxb.export_program(
                name=f"{kind}_bs{bs}",
                args=(tokens, start_pos, seq_lens, seq_block_ids, cache),
                dynamic_shapes=shapes,
                strict=False,
            )
            def _(model, tokens, start_pos, seq_lens, seq_block_ids, cache, final_only=final_only):
                h = model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache)
                return select_logits(model, options, h, start_pos, seq_lens, final_only)

        else:

            @fxb.export_program(
                name=f"{kind}_bs{bs}",
                args=(tokens, seq_lens, seq_block_ids, cache),
                dynamic_shapes=shapes,
                strict=False,
            )
            def _(model, tokens, seq_lens, seq_block_ids, cache, final_only=final_only):
                start_pos = torch.zeros_like(seq_lens)
                h = model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache)
                return select_logits(model, options, h, start_pos, seq_lens, final_only)

        log(f"  traced {kind}_bs{bs} in {time.monotonic() - started:.1f}s")

    for bs in options.decode_batch_sizes:
        started = time.monotonic()
        blocks = Dim("blocks", min=1, max=max_blocks)
        pages = Dim("pages", min=2)
        tokens = torch.zeros(bs, 1, dtype=torch.int64)
        seq_lens = torch.ones(bs, dtype=torch.int64)
        start_positions = torch.zeros(bs, dtype=torch.int64)
        seq_block_ids = torch.zeros(bs, 3, dtype=torch.int64)
        cache = model.allocate_cache(example_pages, cache_dtype)
        shapes = {
            "tokens": {},
            "seq_lens": {},
            "start_positions": {},
            "seq_block_ids": {1: blocks},
            "cache": {0: pages},
        }

        @fxb.export_program(
            name=f"decode_bs{bs}",
            args=(tokens, seq_lens, start_positions, seq_block_ids, cache),
            dynamic_shapes=shapes,
            strict=False,
        )
        def _(model, tokens, seq_lens, start_positions, seq_block_ids, cache):
            h = model.forward_paged(tokens, start_positions, seq_lens, seq_block_ids, cache)
            return select_logits(model, options, h, start_positions, seq_lens)

        log(f"  traced decode_bs{bs} in {time.monotonic() - started:.1f}s")

    started = time.monotonic()
    output = aot.export(fxb)
    log(f"  imported to MLIR in {time.monotonic() - started:.1f}s")
    return output
