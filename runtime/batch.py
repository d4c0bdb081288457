"""A batch: one model call's work as plain data, from the scheduler to the executor.

The scheduler decides it; the executor turns it into the ABI's argument arrays
(`invocation.py`); the scheduler and the output processor read the results back by
the same rows. It holds no live object: page tables are copied in, sequences are
named by id, so building and checking the arguments needs no scheduler and no device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(str, enum.Enum):
    PREFILL = "prefill"  # write a chunk of each row's prompt (and sample where it completes one)
    DECODE = "decode"  # feed each row's last token and sample the next
    DENOISE = "denoise"  # a diffusion LM's pass over each row's window (logits at every position)
    VERIFY = "verify"  # APD: the verifier's prefill over each row's draft (logits at every position)
    # Speculative decoding: each row feeds its last token and its draft tokens, a decode row
    # each, and the logits of every one say how much of the draft the model agrees with.
    SPECULATE = "speculate"
    # Prefill's chunks for embeddings (embed_bs<N>): the final hidden states instead of logits,
    # at every position of a row that pools them all, else at its last.
    EMBED = "embed"


@dataclass(frozen=True)
class Batch:
    phase: Phase
    batch_size: int  # the exported function's N; rows past len(seq_ids) are padding
    seq_ids: tuple[int, ...]  # which sequence each row is
    starts: tuple[int, ...]  # position of each row's first token
    tokens: tuple[tuple[int, ...], ...]  # the tokens each row feeds, from its start position
    block_tables: tuple[tuple[int, ...], ...]  # each row's pages in sequence order, covering its tokens
    samples: tuple[bool, ...]  # rows whose last logits are sampled: a completed prompt, every decode row
    # Rows that need the logits at every position (prompt logprobs); in a denoise batch, all
    # rows or none (then each position's greedy summary, from denoise_top).
    full_logits: tuple[bool, ...]
    # What each row's attention sees when it reaches past its tokens (a diffusion LM's window
    # attends to cached K/V on both sides); empty: each row ends at its last token.
    visible: tuple[int, ...] = ()
    # Each row's LoRA adapter slot (0: the base model), for a build with adapter slots; empty: all 0.
    lora_slots: tuple[int, ...] = ()
    # Rows whose tokens the compiled sampler chooses (sample_bs<N>): each row's (temperature, top_k,
    # top_p, min_p, uniform number), temperature 0 for greedy ones; empty: the host samples.
    device_sampling: tuple[tuple[float, int, float, float, float], ...] = ()

    @property
    def rows(self) -> int:
        return len(self.seq_ids)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Tokens each row's attention covers: the sequence once this batch has run."""
        if self.visible:
            return self.visible
        return tuple(start + len(chunk) for start, chunk in zip(self.starts, self.tokens))

    @property
    def token_count(self) -> int:
        return sum(len(chunk) for chunk in self.tokens)

    def one_row_batches(self) -> list[Batch]:
        """Each row alone, as a batch of one: the same work, one call per row."""
        def row(values: tuple, at: int) -> tuple:
            return values[at:at + 1] if values else ()

        return [Batch(self.phase, 1, row(self.seq_ids, at), row(self.starts, at), row(self.tokens, at),
                      row(self.block_tables, at), row(self.samples, at), row(self.full_logits, at),
                      row(self.visible, at), row(self.lora_slots, at), row(self.device_sampling, at))
                for at in range(self.rows)]
