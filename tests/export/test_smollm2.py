"""The real SmolLM2-135M-Instruct: exported, compiled for the CPU, run through iree.runtime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.runtime.contract import Artifacts, fixed_decode_context
from kiln.runtime.program import Program
from tests.paged_driver import PagedDriver, relative_error

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]

REFERENCE_PROMPT = "1, 2, 3, 4, 5,"
REFERENCE_CONTINUATION = " 6, 7, 8, 9, 10, 11, 12, 13, 14,"


@pytest.fixture(scope="module")
def program(smollm2_artifacts):
    return Program(Artifacts.in_directory(smollm2_artifacts))


@pytest.fixture(scope="module")
def tokenizer(smollm2_artifacts):
    return Tokenizer.from_file(str(smollm2_artifacts / "tokenizer.json"))


def greedy(program, prompt_ids, steps):
    driver = PagedDriver(program)
    seqs = driver.new_sequences(1, len(prompt_ids) + steps)
    logits = driver.prefill(seqs, [prompt_ids], batch=1)
    out = [int(logits[0, len(prompt_ids) - 1].argmax())]
    while len(out) < steps:
        position = len(prompt_ids) + len(out) - 1
        out.append(int(driver.decode(seqs, [out[-1]], [position], batch=2)[0, 0].argmax()))
    return out


def test_reference_continuation(program, tokenizer):
    prompt_ids = tokenizer.encode(REFERENCE_PROMPT, add_special_tokens=False).ids
    out = greedy(program, prompt_ids, 32)
    assert tokenizer.decode(out) == REFERENCE_CONTINUATION


def test_teacher_forced_logits_match_torch(program, tokenizer, smollm2_checkpoint):
    reference = build_model(smollm2_checkpoint, ExportOptions().validate(2048))
    text = REFERENCE_PROMPT + REFERENCE_CONTINUATION
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    with torch.no_grad():
        want = reference.forward_reference(torch.tensor([ids])).numpy()[0]
    driver = PagedDriver(program)
    seqs = driver.new_sequences(4, len(ids))
    prompt = ids[:30]
    logits = driver.prefill(seqs[:1], [prompt], batch=1)
    assert relative_error(logits[0, :30], want[:30]) < 1e-4
    for position in range(30, len(ids)):
        logits = driver.decode(seqs[:1], [ids[position]], [position], batch=2)
        assert relative_error(logits[0, 0], want[position]) < 1e-4
    # The same prompt as one row of a batch of 4 gives the same logits.
    batch = driver.prefill(seqs[1:3], [ids[:20], prompt], batch=4)
    assert relative_error(batch[1, :30], want[:30]) < 1e-4
    assert relative_error(batch[0, :20], want[:20]) < 1e-4


def test_every_exported_batch_size_matches_torch(program, smollm2_checkpoint):
    """Each compiled function on its own, every row checked: IREE can miscompile one batch
    size of a form it compiles right at the others (decode_bs1 once did, only on SmolLM2).
    Decode runs both its forms: the fixed-shape one (a cache of the export's page count) and
    decode_bs<N>."""
    reference = build_model(smollm2_checkpoint, ExportOptions().validate(2048))
    rng = np.random.default_rng(3)
    sizes = {kind: sorted(int(name.rsplit("_bs", 1)[1]) for name in program.functions
                          if fixed_decode_context(name) is None and name.rsplit("_bs", 1)[0] == kind)
             for kind in ("prefill", "prefill_last", "decode")}
    assert sizes["prefill"] and sizes["decode"]

    def expected(ids):
        with torch.no_grad():
            return reference.forward_reference(torch.tensor([ids])).numpy()[0]

    for kind in ("prefill", "prefill_last"):
        for batch in sizes[kind]:
            driver = PagedDriver(program)
            prompts = [[int(t) for t in rng.integers(0, 49152, int(n))] for n in rng.integers(3, 40, batch)]
            seqs = driver.new_sequences(batch, 48)
            logits = driver.prefill(seqs, prompts, batch=batch, function=kind)
            for row, prompt in enumerate(prompts):
                got = logits[row, len(prompt) - 1] if kind == "prefill" else logits[row, 0]
                assert relative_error(got, expected(prompt)[-1]) < 1e-4, f"{kind}_bs{batch} row {row}"

    driver = PagedDriver(program, pages=program.params.paged_kv_cache.device_block_count)
    for batch in sizes["decode"]:
        prompts = [[int(t) for t in rng.integers(0, 49152, int(n))] for n in rng.integers(3, 40, batch)]
        seqs = driver.new_sequences(batch, 48)
        for seq, prompt in zip(seqs, prompts):
            driver.prefill([seq], [prompt], batch=1)
        nexts = [int(t) for t in rng.integers(0, 49152, batch)]
        for dynamic in (False, True):  # the same token at the same position: the same K/V written twice
            logits = driver.decode(seqs, nexts, [len(p) for p in prompts], batch=batch, dynamic=dynamic)
            for row, (prompt, token) in enumerate(zip(prompts, nexts)):
                assert relative_error(logits[row, 0], expected(prompt + [token])[-1]) < 1e-4, \
                    f"decode_bs{batch} (dynamic: {dynamic}) row {row}"
