"""Drive a compiled model's prefill/decode functions directly, for tests of the ABI.

Lays out pages by hand (page 0 stays the padding page), pads rows and lengths as
the contract says, and returns logits as numpy arrays.
"""

from __future__ import annotations

import time

import numpy as np

from kiln.runtime.program import Program


class PagedDriver:
    def __init__(self, program: Program, pages: int = 64):
        self.program = program
        self.stride = program.params.block_seq_stride
        self.pages = pages
        # A model whose pages hold its layers by groups: each page here has a page per group.
        groups = program.capabilities.page_groups
        self.groups = groups.count if groups else 0
        self.cache = program.allocate_cache(pages * self.groups + 1 if groups else pages)
        self.next_page = 1
        self.tables: list[list[int]] = []

    def new_sequences(self, count: int, max_len: int) -> list[int]:
        """Give `count` sequences enough pages for max_len tokens; returns their indices."""
        blocks = -(-max_len // self.stride)
        start = len(self.tables)
        for _ in range(count):
            self.tables.append(list(range(self.next_page, self.next_page + blocks)))
            self.next_page += blocks
        return list(range(start, start + count))

    def _block_table(self, seqs: list[int], batch: int, blocks: int) -> np.ndarray:
        table = np.zeros((batch, blocks), np.int64)  # padded rows and blocks point at page 0
        for row, seq in enumerate(seqs):
            pages = self.tables[seq][:blocks]
            table[row, : len(pages)] = pages
        if not self.groups:
            return table
        # Page p's page in group g: (p - 1) * groups + g + 1; page 0 stays 0 in every group.
        per_group = np.arange(self.groups).reshape(1, -1, 1) + 1
        return np.where(table[:, None, :] > 0, (table[:, None, :] - 1) * self.groups + per_group, 0)

    def prefill(self, seqs, prompts, batch: int, start_pos=None, function: str = "prefill") -> np.ndarray:
        """Logits [batch, T, V] (or [batch, 1, V]) for each prompt written at start_pos."""
        start_pos = start_pos or [0] * len(prompts)
        longest = max(len(p) for p in prompts)
        t = -(-longest // self.stride) * self.stride
        tokens = np.zeros((batch, t), np.int64)
        seq_lens = np.ones(batch, np.int64)
        starts = np.zeros(batch, np.int64)
        for row, (prompt, start) in enumerate(zip(prompts, start_pos)):
            tokens[row, : len(prompt)] = prompt
            seq_lens[row] = start + len(prompt)
            starts[row] = start
        blocks = -(-int(max(s + t for s in starts)) // self.stride)
        table = self._block_table(seqs, batch, blocks)
        args = [tokens, starts, seq_lens, table, self.cache]
        if not self.program.params.has_prefill_position:
            args.pop(1)
        return self.program.invoke(f"{function}_bs{batch}", *args)[0]

    def decode(self, seqs, tokens, positions, batch: int, dynamic: bool = False) -> np.ndarray:
        """Logits [batch, 1, V] for one new token per sequence at `positions`, from the decode the
        server would call (a fixed-shape one where the export has it and the cache fits it), or
        from decode_bs<N> itself if `dynamic`."""
        token_arr = np.zeros((batch, 1), np.int64)
        seq_lens = np.ones(batch, np.int64)
        starts = np.zeros(batch, np.int64)
        for row, (token, pos) in enumerate(zip(tokens, positions)):
            token_arr[row, 0] = token
            seq_lens[row] = pos + 1
            starts[row] = pos
        name, blocks = self.program.capabilities.decode_function(batch, int(seq_lens.max()), self.pages)
        if dynamic:
            name, blocks = f"decode_bs{batch}", -(-int(seq_lens.max()) // self.stride)
        table = self._block_table(seqs, batch, blocks)
        return self.program.invoke(name, token_arr, seq_lens, starts, table, self.cache)[0]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def call_ms(program, name: str, args, repeats: int = 20) -> float:
    """The mean wall time of `repeats` calls of `name` after three warm-up calls, in ms."""
    for _ in range(3):
        program.invoke(name, *args)
    started = time.perf_counter()
    for _ in range(repeats):
        program.invoke(name, *args)
    return (time.perf_counter() - started) / repeats * 1000
