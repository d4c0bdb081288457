"""The diffusion generation layer without a device: commit rules, request plans, canvas windows,
and the scheduler's batches and page accounting over a fake cache pool."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.batch import Phase
from kiln.runtime.diffusion.canvas import Canvas
from kiln.runtime.diffusion.commit import choose, confidence, predict, transfer_schedule
from kiln.runtime.diffusion.mode import DiffusionDecoding
from kiln.runtime.diffusion.params import DiffusionParams
from kiln.runtime.diffusion.scheduler import DiffusionScheduler, DiffusionSchedulerConfig
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.finishing import Finish, Stopping
from kiln.runtime.kvcache.page_pool import PagePool
from kiln.runtime.kvcache.plain_cache import PlainPagedAttentionCache
from kiln.runtime.request import Request, Sequence, SequenceState
from kiln.runtime.sampling import SamplingParams
from tests.tiny_model import make_tiny_tokenizer

MASK, VOCAB = 4, 12


def test_the_schedule_spreads_commits_remainder_first():
    assert transfer_schedule(32, 8) == [4] * 8
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(3, 5) == [1, 1, 1, 0, 0]
    assert sum(transfer_schedule(17, 6)) == 17


def test_choose_by_count_or_threshold():
    scores = np.array([0.2, 0.9, 0.5, 0.95, 0.1])
    assert choose(scores, 2, None).tolist() == [3, 1]
    assert choose(scores, None, 0.5).tolist() == [3, 1, 2]
    assert choose(scores, None, 0.99).tolist() == [3]  # the most confident always commits
    assert choose(np.array([0.5, 0.5]), 1, None).tolist() == [0]  # ties: the earlier position


def test_confidence_measures():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    tokens = predict(logits, 0.0, np.random.default_rng(0))
    assert tokens.tolist() == [0, 0]
    np.testing.assert_allclose(confidence(logits, tokens, "top1"), [0.7, 0.4])
    np.testing.assert_allclose(confidence(logits, tokens, "margin"), [0.5, 0.05])
    entropy = [sum(p * np.log(p + 1e-10) for p in row) for row in ([0.7, 0.2, 0.1], [0.4, 0.35, 0.25])]
    np.testing.assert_allclose(confidence(logits, tokens, "entropy"), entropy)


def test_sampling_with_temperature_follows_the_distribution():
    logits = np.log(np.array([[0.6, 0.3, 0.1]] * 20000))
    counts = np.bincount(predict(logits, 1.0, np.random.default_rng(1)), minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.02)


@pytest.mark.parametrize("params,max_tokens,field", [
    (DiffusionParams(steps=7, block_length=8), 32, "steps"),
    (DiffusionParams(block_length=0), 32, "block_length"),
    (DiffusionParams(remasking="x"), 32, "remasking"),
    (DiffusionParams(confidence="x"), 32, "confidence"),
    (DiffusionParams(cache="x"), 32, "cache"),
    (DiffusionParams(threshold=-0.1), 32, "threshold"),
    (DiffusionParams(cfg_scale=float("nan")), 32, "cfg_scale"),
    (DiffusionParams(cfg_scale=1.0, cache="prefix"), 32, "cfg_scale"),
    (DiffusionParams(apd_mixture_weight=0.5, threshold=0.9), 32, "threshold"),
])
def test_bad_plans_name_the_field(params, max_tokens, field):
    with pytest.raises(InvalidRequestError) as error:
        params.plan(max_tokens)
    assert error.value.param == field


def test_plans_round_up_to_whole_blocks():
    plan = DiffusionParams().plan(20)
    assert (plan.block_length, plan.blocks, plan.steps_per_block, plan.canvas_length) == (20, 1, 20, 20)
    plan = DiffusionParams(block_length=8).plan(20)
    assert (plan.blocks, plan.canvas_length, plan.steps_per_block) == (3, 24, 8)
    assert DiffusionParams(steps=6, block_length=8).plan(20).steps_per_block == 2
    assert DiffusionParams().plan(100).block_length == 32


def fake_logits(tokens: np.ndarray, favourite: dict[int, int]) -> np.ndarray:
    """Logits [T, VOCAB]: position p strongly prefers favourite[p] (else token 5), more so further left."""
    out = np.zeros((len(tokens), VOCAB), np.float32)
    for row in range(len(tokens)):
        out[row, favourite.get(row, 5)] = 10.0 - 0.1 * row
    return out


@pytest.mark.parametrize("cache,shift", [("none", 0), ("prefix", 0), ("dual", 0), ("dual", 1), ("prefix", 1)])
def test_canvas_windows_by_cache_mode(cache, shift):
    prompt = [7, 8, 9]
    canvas = Canvas(prompt, DiffusionParams(block_length=4, cache=cache, threshold=0.0).plan(8), MASK, shift,
                    0.0, np.random.default_rng(0))
    first = canvas.window()
    assert (first.start, first.width, first.visible) == (0, 11, 11)  # a refresh: the whole sequence
    canvas.commit(fake_logits(first.tokens, {}))  # threshold 0: the whole block in one pass
    assert canvas.block == 1 and canvas.committed_prefix() == 4
    refresh = canvas.window()
    assert (refresh.start, refresh.width) == (0, 11)  # a new block starts with a refresh
    canvas.commit(fake_logits(refresh.tokens, {}))
    assert canvas.done and canvas.tokens[3:].tolist() == [5] * 8 and canvas.forward_passes == 2


def test_a_cached_window_covers_the_block_and_reads_shifted_logits():
    canvas = Canvas([7, 8, 9], DiffusionParams(block_length=4, steps=8, cache="dual").plan(8), MASK, 1, 0.0,
                    np.random.default_rng(0))
    canvas.commit(fake_logits(canvas.window().tokens, {}))  # refresh: commits one of four
    window = canvas.window()
    assert (window.start, window.width, window.visible) == (2, 5, 11)  # one token before the block
    # Row j of the window predicts position start + j + 1: row 3 (position 6), surest of all, prefers 9.
    logits = fake_logits(window.tokens, {3: 9})
    logits[3, 9] = 30.0
    canvas.commit(logits)
    assert canvas.tokens[6] == 9 and canvas.tokens[5] == MASK


def test_a_mask_is_never_committed():
    canvas = Canvas([7], DiffusionParams(block_length=2).plan(2), MASK, 0, 0.0, np.random.default_rng(0))
    logits = np.zeros((3, VOCAB), np.float32)
    logits[:, MASK] = 50.0  # the model "prefers" the mask token everywhere
    logits[:, 6] = 1.0
    canvas.commit(logits)
    canvas.commit(logits)
    assert canvas.done and canvas.tokens[1:].tolist() == [6, 6]


def scheduler(pages=40, sizes=(1, 4), max_running=8, has_denoise_top=False):
    pool = PagePool(pages, lambda n: None)
    cache = PlainPagedAttentionCache(pool, 4)
    config = DiffusionSchedulerConfig(denoise_batch_sizes=sizes, block_seq_stride=4, max_running=max_running,
                                      mask_token_id=MASK, logits_shift=0, has_denoise_top=has_denoise_top)
    return DiffusionScheduler(config, cache), cache


def sequence(prompt, priority=0, temperature=0.0, **diffusion) -> Sequence:
    params = SamplingParams(max_tokens=8, temperature=temperature, diffusion=DiffusionParams(**diffusion))
    request = Request(list(prompt), params, f"r{id(params)}", priority=priority)
    seq = Sequence(request, 0)
    request.sequences.append(seq)
    return seq


def test_whole_sequence_rows_share_a_call_and_cached_blocks_group_by_width():
    sched, cache = scheduler()
    a, b = sequence([7] * 5, block_length=8), sequence([7] * 7, block_length=8)  # widths 13 and 15: one page bucket
    c = sequence([7] * 5, block_length=4, cache="dual")
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.phase is Phase.DENOISE and set(batch.seq_ids) == {a.seq_id, b.seq_id, c.seq_id}
    assert batch.batch_size == 4 and batch.visible == (13, 15, 13)
    sched.commit(batch, [fake_logits(np.array(t), {}) for t in batch.tokens])
    assert c.mode_state.pass_kind == "dual"
    cache.check_integrity()
    # c's dual window (width 4) cannot be padded beside the others: it runs in a call of its own.
    seen = []
    for _ in range(2):
        batch = sched.schedule()
        seen.append((batch.seq_ids, batch.visible))
        sched.commit(batch, [fake_logits(np.array(t), {}) for t in batch.tokens])
    assert ((c.seq_id,), (13,)) in seen


def test_guidance_takes_two_rows_and_twice_the_pages_and_all_come_back():
    sched, cache = scheduler(pages=9)
    seq = sequence([7] * 6, cfg_scale=1.0)  # 14 tokens: 4 pages, twice
    sched.add(seq)
    batch = sched.schedule()
    assert batch.seq_ids == (seq.seq_id, seq.seq_id) and batch.tokens[1][:6] == (MASK,) * 6
    assert cache.stats().active == 8
    waiting = sequence([7] * 6)
    sched.add(waiting)
    assert sched.schedule().seq_ids == (seq.seq_id, seq.seq_id)  # no pages left: the next waits
    assert waiting.state is SequenceState.WAITING
    sched.finish(seq, "abort")
    assert cache.stats().active == 0 and sched.schedule().seq_ids == (waiting.seq_id,)
    cache.check_integrity()


def test_a_stop_token_in_the_committed_prefix_finishes_there():
    sched, cache = scheduler()
    seq = sequence([7, 7], block_length=8, threshold=0.0)
    sched.add(seq)
    batch = sched.schedule()
    stopping = Stopping(make_tiny_tokenizer(), eos_token_ids=[1])
    stopping.add(seq.request)
    [advance] = DiffusionDecoding(sched, capabilities=None).update(batch, [0], sched.sequences_of(batch),
                                                [fake_logits(np.array(batch.tokens[0]), {4: 1})])  # EOS at position 4
    for sample in advance.samples:  # as the batcher takes them: up to the first that ends it
        finish = stopping.take(seq, sample.token_id, counts_max_tokens=False).finish
        if finish is not None:
            break
    assert seq.output_ids == [5, 5, 1] and finish == Finish("stop", stop_token=1)
    sched.finish(seq, "stop")
    assert seq.state is SequenceState.FINISHED and cache.stats().active == 0


def test_greedy_batches_read_summaries_and_sampled_ones_read_logits():
    sched, _ = scheduler(has_denoise_top=True)
    greedy = sequence([7] * 5)
    sched.add(greedy)
    batch = sched.schedule()
    assert batch.full_logits == (False,)  # denoise_top: four numbers a position
    summary = np.zeros((len(batch.tokens[0]), 4), np.float32)
    summary[:, 0], summary[:, 1] = 6, np.linspace(0.9, 0.1, len(summary))
    sched.commit(batch, [summary])
    assert greedy.mode_state.tokens[5] == 6 and greedy.mode_state.forward_passes == 1
    sampled = sequence([7] * 5, temperature=0.7)
    sched.add(sampled)
    batch = sched.schedule()
    assert set(batch.seq_ids) == {greedy.seq_id, sampled.seq_id} and batch.full_logits == (True, True)
