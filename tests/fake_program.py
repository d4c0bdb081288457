"""A deterministic stand-in for a compiled model, so the scheduler, the service and the HTTP
layer can be tested without compiling anything.

It honours the contract the way a real export does: it writes each token into its page
of the cache at its position and reads every earlier token back through the block table,
and the next token is a fixed function of the whole prefix it read. So a wrong page, a
wrong start position or a stale prefix-cache hit changes the output, exactly as it would
on a real model; and `expected_greedy` says what the right output is.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.runtime.config import KilnParams, ModelParams, PagedKVCacheParams, save_model_config
from kiln.runtime.contract import (
    CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Artifacts, Capabilities, FunctionKind, argument_names,
    expected_functions, parse_function_name,
)

VOCAB = 384
HIDDEN = 8  # the width of its embed functions' hidden states
EOS = 1
_MULTIPLIER, _MODULUS = 1_000_003, 2**31 - 1


def next_token(prefix: list[int]) -> int:
    """The fake model's greedy choice after `prefix` (never EOS, never a special id below 4)."""
    h = 0
    for position, token in enumerate(prefix):
        h = (h * _MULTIPLIER + (token + 1) * (position + 7)) % _MODULUS
    return 4 + h % (VOCAB - 4)


def expected_greedy(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def _logits(prefix: list[int]) -> np.ndarray:
    """A peaked distribution around next_token: greedy picks it, sampling sees a real spread."""
    best = next_token(prefix)
    distance = np.abs(np.arange(VOCAB) - best).astype(np.float32)
    return -distance


def hidden_state(prefix: list[int]) -> np.ndarray:
    """The fake model's final hidden state at the end of `prefix`: a fixed function of it."""
    h = 0
    for position, token in enumerate(prefix):
        h = (h * _MULTIPLIER + (token + 1) * (position + 7)) % _MODULUS
    return np.cos(np.arange(1, HIDDEN + 1, dtype=np.float32) * (1 + h % 997) / 997)


def write_fake_artifacts(directory: Path, tokenizer_json: str, tokenizer_config: dict | None = None,
                         stride: int = 4, max_seq_len: int = 256, pages: int = 64,
                         prefill_sizes=(1, 4), decode_sizes=(1, 4), has_prefill_position: bool = True,
                         embeddings: bool = False) -> Artifacts:
    """model.json (+ sidecar) and the tokenizer: what a FakeProgram reads in place of a VMFB;
    with `embeddings`, embed functions for every prefill size (last-token pooling, normalised)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    params = ModelParams(
        max_seq_len=max_seq_len, transformer_block_count=1, attn_head_dim=1,
        prefill_batch_sizes=list(prefill_sizes), decode_batch_sizes=list(decode_sizes),
        has_prefill_position=has_prefill_position, attn_dtype="float32",
        paged_kv_cache=PagedKVCacheParams(stride, 1, pages, "float32"),
    )
    kiln = KilnParams(vocab_size=VOCAB, eos_token_ids=[EOS], hidden_size=HIDDEN)
    if embeddings:
        kiln.embed_batch_sizes = list(prefill_sizes)
        kiln.embedding = {"pooling": "last", "normalize": True, "matryoshka_dimensions": [4]}
    save_model_config(directory / CONFIG_FILE, params, kiln)
    (directory / TOKENIZER_FILE).write_text(tokenizer_json)
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config or {}))
    return Artifacts.in_directory(directory)


class FakeProgram:
    """What GenerateService and the Executor use of a Program, computed in numpy."""

    def __init__(self, artifacts: Artifacts, device: str = "local-task", parameter_memory: str = "auto"):
        from kiln.runtime.config import load_model_config

        self.params, kiln = load_model_config(artifacts.config)
        self.kiln = kiln or KilnParams()
        names = expected_functions(self.params, True, self.kiln)
        self.capabilities = Capabilities.of(self.params, self.kiln, names)
        self.calls: list[str] = []  # every function called, in order
        self.devices = [device]  # one device, as Program holds its HAL devices

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def page_elems(self) -> int:
        return self.params.page_elems

    @property
    def block_elems(self) -> int:
        return self.params.page_elems

    def allocate_cache(self, pages: int) -> np.ndarray:
        # One token id per slot (k: page, stride slots); -1 where nothing was written.
        return np.full((pages, self.params.block_seq_stride), -1, np.int64)

    def call(self, name: str, *args) -> np.ndarray:
        kind, batch_size = parse_function_name(name)
        names = argument_names(kind, self.params.has_prefill_position)
        values = dict(zip(names, args))
        tokens, seq_lens, table, cache = (values["tokens"], values["seq_lens"], values["seq_block_ids"],
                                          values["cache"])
        assert tokens.shape[0] == batch_size and len(args) == len(names)
        starts = values.get("start_pos", values.get("start_positions", np.zeros_like(seq_lens)))
        stride = self.params.block_seq_stride
        self.calls.append(name)
        rows, width = tokens.shape
        last_only = kind not in (FunctionKind.PREFILL, FunctionKind.EMBED)
        out = np.zeros((rows, 1 if last_only else width, HIDDEN if kind is FunctionKind.EMBED else VOCAB), np.float32)
        row_output = hidden_state if kind is FunctionKind.EMBED else self.logits
        for row in range(rows):
            start, end = int(starts[row]), int(seq_lens[row])
            for offset in range(end - start):  # write this call's tokens into their pages
                position = start + offset
                cache[table[row, position // stride], position % stride] = tokens[row, offset]
            prefix = [int(cache[table[row, p // stride], p % stride]) for p in range(end)]
            if last_only:
                out[row, 0] = row_output(prefix)
            else:
                for offset in range(end - start):
                    out[row, offset] = row_output(prefix[: start + offset + 1])
        cache[0] = -1  # page 0 is the padding page: whatever was written there is garbage
        return out

    def logits(self, prefix: list[int]) -> np.ndarray:
        """The row of logits after `prefix` (a subclass may script other replies)."""
        return _logits(prefix)
