"""A Batch as the ABI's arguments: built and checked as a pure function, no device."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kiln.runtime.batch import Batch, Phase
from kiln.runtime.contract import Capabilities
from kiln.runtime.invocation import InvocationError, build_invocation

ABI = Capabilities(prefill_batch_sizes=(1, 4), decode_batch_sizes=(2, 4), prefill_last_batch_sizes=(1, 4),
                   has_prefill_position=True, prefill_returns_last_only=False, block_seq_stride=4, max_seq_len=64)


def batch(phase=Phase.PREFILL, size=4, tokens=((5, 6, 7), (8, 9, 10, 11, 12)), starts=(0, 4),
          tables=((1,), (2, 3, 4)), samples=None, full=None):
    rows = len(tokens)
    return Batch(phase, size, tuple(range(rows)), tuple(starts), tuple(map(tuple, tokens)),
                 tuple(map(tuple, tables)), tuple(samples or (True,) * rows), tuple(full or (False,) * rows))


def test_prefill_arguments_follow_the_contract_and_pad():
    inv = build_invocation(batch(), ABI, page_count=8, vocab_size=32)
    assert inv.function == "prefill_last_bs4"  # no row needs every position: the fast path
    tokens, starts, seq_lens, table = inv.arguments
    assert tokens.shape == (4, 8) and tokens.dtype == np.int64  # T: the longest chunk in whole pages
    assert tokens[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0] and tokens[2].tolist() == [0] * 8
    assert starts.tolist() == [0, 4, 0, 0] and seq_lens.tolist() == [3, 9, 1, 1]  # padding rows: 1 token
    assert table.tolist() == [[1, 0, 0], [2, 3, 4], [0, 0, 0], [0, 0, 0]]  # page 0 pads
    assert inv.read_at == ((0, 0), (1, 0))


def test_rows_wanting_every_position_call_the_full_prefill():
    inv = build_invocation(batch(full=(True, False), samples=(True, False)), ABI, 8, 32)
    assert inv.function == "prefill_bs4" and inv.read_at == ((0, slice(0, 3)), (1, 4))
    assert inv.wanted == (True, False)


def test_decode_argument_order_differs_from_prefill():
    inv = build_invocation(batch(Phase.DECODE, 2, tokens=((7,), (9,)), starts=(3, 8), tables=((1,), (2, 3, 4))),
                           ABI, 8, 32)
    tokens, seq_lens, starts, table = inv.arguments
    assert inv.function == "decode_bs2" and tokens.tolist() == [[7], [9]]
    assert seq_lens.tolist() == [4, 9] and starts.tolist() == [3, 8] and table.shape == (2, 3)


def test_a_speculation_batch_is_one_decode_call_with_a_row_per_token():
    """Each draft token its own decode row at its own position, over its sequence's pages: the
    logits of a sequence's rows read back together."""
    speculate = batch(Phase.SPECULATE, 4, tokens=((7, 8, 9), (3,)), starts=(3, 8), tables=((1, 2), (3, 4, 5)),
                      full=(True, True))
    inv = build_invocation(speculate, ABI, 8, 32)
    tokens, seq_lens, starts, table = inv.arguments
    assert inv.function == "decode_bs4" and tokens.tolist() == [[7], [8], [9], [3]]
    assert starts.tolist() == [3, 4, 5, 8] and seq_lens.tolist() == [4, 5, 6, 9]
    assert table.tolist() == [[1, 2, 0], [1, 2, 0], [1, 2, 0], [3, 4, 5]]
    assert inv.read_at == ((slice(0, 3), 0), (slice(3, 4), 0)) and inv.wanted == (True, True)
    with pytest.raises(InvocationError, match="5 tokens for a decode of 4 rows"):
        build_invocation(replace(speculate, tokens=((7, 8, 9, 10), (3,))), ABI, 8, 32)


def test_decode_calls_the_smallest_fixed_shape_bucket_that_fits_the_cache_and_the_rows():
    abi = replace(ABI, decode_buckets=(16, 64), fixed_page_count=8)
    decode = batch(Phase.DECODE, 2, tokens=((7,), (9,)), starts=(3, 8), tables=((1,), (2, 3, 4)))
    inv = build_invocation(decode, abi, 8, 32)
    table = inv.arguments[3]
    assert inv.function == "decode_bs2_ctx16" and table.tolist() == [[1, 0, 0, 0], [2, 3, 4, 0]]
    longer = batch(Phase.DECODE, 2, tokens=((7,), (9,)), starts=(3, 16), tables=((1,), (2, 3, 4, 5, 6)))
    inv = build_invocation(longer, abi, 8, 32)
    assert inv.function == "decode_bs2_ctx64" and inv.arguments[3].shape == (2, 16)
    # A cache of another size than the export's: the decode whose shapes are dynamic.
    inv = build_invocation(decode, abi, 9, 32)
    assert inv.function == "decode_bs2" and inv.arguments[3].shape == (2, 3)
    # Rows longer than every bucket: the same.
    assert replace(ABI, decode_buckets=(16,), fixed_page_count=8).decode_function(2, 17, 8) == ("decode_bs2", 5)


def test_an_export_without_start_positions_gets_no_start_argument():
    abi = Capabilities((1,), (2,), (), False, False, 4, 64)
    inv = build_invocation(batch(size=1, tokens=((5, 6),), starts=(0,), tables=((1,),)), abi, 8, 32)
    assert inv.function == "prefill_bs1" and len(inv.arguments) == 3
    with pytest.raises(InvocationError, match="start position"):
        build_invocation(batch(size=1, tokens=((5, 6),), starts=(4,), tables=((1, 2),)), abi, 8, 32)


@pytest.mark.parametrize("changes, message", [
    (dict(tables=((9,), (2, 3, 4))), "page id"),
    (dict(tables=((1,), (2, 3))), "lacks pages"),
    (dict(tokens=((5, 6, 40), (8,))), "vocabulary"),
    (dict(tokens=((5, -1), (8,))), "vocabulary"),
    (dict(starts=(0, 62), tables=((1,), tuple(range(1, 18)))), "max_seq_len"),
    (dict(size=1), "rows for a batch"),
    (dict(tokens=((), (8,))), "no token"),
])
def test_anything_off_the_contract_never_reaches_the_device(changes, message):
    with pytest.raises(InvocationError, match=message):
        build_invocation(batch(**changes), ABI, page_count=8, vocab_size=32)


def test_decode_rows_feed_one_token_and_never_want_every_position():
    with pytest.raises(InvocationError, match="one token"):
        build_invocation(batch(Phase.DECODE, 2, tokens=((7, 8), (9,)), tables=((1,), (2, 3))), ABI, 8, 32)
    last_only = Capabilities((1, 4), (2,), (), True, True, 4, 64)
    with pytest.raises(InvocationError, match="every position"):
        build_invocation(batch(full=(True, False)), last_only, 8, 32)
