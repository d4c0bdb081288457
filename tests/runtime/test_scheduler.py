"""The scheduler's decisions, without a device: admission, alternation, chunks, preemption."""

from __future__ import annotations

from kiln.runtime.kvcache.page_pool import PagePool
from kiln.runtime.kvcache.plain_cache import PlainPagedAttentionCache
from kiln.runtime.kvcache.trie_cache import TriePagedAttentionCache
from kiln.runtime.request import Request, Sequence, SequenceStatus
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig


def make(pages=64, chunk=32, trie=False, prefill=(1, 4), decode=(1, 4)):
    pool = PagePool(pages)
    cache = (TriePagedAttentionCache if trie else PlainPagedAttentionCache)(pool, 4)
    config = SchedulerConfig(list(prefill), list(decode), block_seq_stride=4, max_seq_len=256, chunk_tokens=chunk)
    return Scheduler(config, cache), cache


def seq(length, priority=0, name="r"):
    request = Request(list(range(10, 10 + length)), SamplingParams(max_tokens=50), name, priority=priority)
    sequence = Sequence(request, 0)
    request.sequences.append(sequence)
    return sequence


def complete(scheduler, batch, token=7):
    """What the batcher does after a step, minus sampling: K/V written, a token appended."""
    for s, chunk, samples in zip(batch.seqs, batch.chunks, batch.samples):
        s.computed += len(chunk)
        if samples:
            s.tokens.append(token)


def test_priority_orders_admission():
    scheduler, _ = make(prefill=(1,))
    low, high, mid = seq(5, priority=5, name="low"), seq(5, priority=-1, name="high"), seq(5, priority=0, name="mid")
    for s in (low, high, mid):
        scheduler.add(s)
    order = []
    for _ in range(3):
        batch = scheduler.schedule()
        assert batch.kind == "prefill"
        order.append(batch.seqs[0].request.request_id)
        complete(scheduler, batch)
        # Nothing else: finish decoders so only prefills are compared.
        for s in list(scheduler.running):
            if not s.in_prefill:
                scheduler.finish(s, "length")
    assert order == ["high", "mid", "low"]


def test_prefill_and_decode_alternate_and_long_prompts_are_chunked():
    scheduler, cache = make(chunk=8)
    short, long_ = seq(3, name="short"), seq(30, name="long")
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch.kind == "prefill" and batch.chunks == [[10, 11, 12]] and batch.samples == [True]
    complete(scheduler, batch)
    scheduler.add(long_)
    kinds, long_chunks = [], []
    while long_.in_prefill:
        batch = scheduler.schedule()
        kinds.append(batch.kind)
        if batch.kind == "prefill":
            long_chunks.append(len(batch.chunks[0]))
            assert batch.samples == [not long_.in_prefill or batch.starts[0] + len(batch.chunks[0]) == 30]
        complete(scheduler, batch)
    assert long_chunks == [8, 8, 8, 6]
    # The short one decodes between the long one's chunks: its new prompt waits one step at most.
    assert kinds == ["decode", "prefill"] * 4
    assert len(short.tokens) == 3 + 1 + 4
    cache.check_integrity()


def test_more_running_than_the_largest_decode_batch_take_turns():
    scheduler, _ = make(decode=(1, 2))
    seqs = [seq(3, name=f"s{i}") for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    while any(s.in_prefill for s in seqs):
        complete(scheduler, scheduler.schedule())
    served = []
    for _ in range(6):
        batch = scheduler.schedule()
        assert batch.kind == "decode" and batch.batch_size == 2
        served += [s.request.request_id for s in batch.seqs]
        complete(scheduler, batch)
    assert sorted(served.count(name) for name in ("s0", "s1", "s2")) == [4, 4, 4]


def test_prefill_takes_as_many_rows_as_a_batch_size_they_fill():
    """A padding row costs a real row's compute: 2-3 ready prompts with sizes [1, 4] go one
    at a time, 4 or more fill a batch of 4."""
    scheduler, _ = make(prefill=(1, 4), decode=(16,))
    for i in range(3):
        scheduler.add(seq(5, name=f"a{i}"))
    sizes = []
    while (batch := scheduler.schedule()) is not None and batch.kind == "prefill":
        sizes.append((batch.batch_size, len(batch.seqs)))
        complete(scheduler, batch)
        scheduler.last_kind = "decode"  # look at prefill decisions only
    assert sizes == [(1, 1), (1, 1), (1, 1)]
    scheduler, _ = make(prefill=(1, 4), decode=(16,))
    for i in range(5):
        scheduler.add(seq(5, name=f"b{i}"))
    batch = scheduler.schedule()
    assert (batch.batch_size, len(batch.seqs)) == (4, 4)


def test_the_youngest_is_preempted_and_recomputed_without_resampling():
    scheduler, cache = make(pages=5, chunk=64, prefill=(1, 2))  # 4 usable pages of 4 tokens
    old, young = seq(6, name="old"), seq(6, name="young")
    scheduler.add(old)
    scheduler.add(young)
    batch = scheduler.schedule()
    assert batch.kind == "prefill" and len(batch.seqs) == 2
    complete(scheduler, batch)  # both: 7 tokens in 2 pages each; the pool is empty
    for _ in range(2):  # positions 6 and 7 fit in those pages
        batch = scheduler.schedule()
        assert len(batch.seqs) == 2
        complete(scheduler, batch)
    batch = scheduler.schedule()  # position 8 needs a third page: only by preempting
    assert batch.kind == "decode" and [s.request.request_id for s in batch.seqs] == ["old"]
    assert young.status is SequenceStatus.WAITING and young.preemptions == 1 and young.computed == 0
    assert young.prefill_target == len(young.tokens) - 1
    scheduler.finish(old, "length")
    batch = scheduler.schedule()
    assert batch.kind == "prefill" and batch.seqs == [young] and batch.samples == [False]
    assert batch.chunks == [young.tokens[:-1]]
    complete(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.kind == "decode" and batch.starts == [len(young.tokens) - 1]
    cache.check_integrity()


def test_a_sibling_waits_for_its_leader_and_reuses_its_pages():
    scheduler, cache = make(trie=True)
    request = Request(list(range(10, 19)), SamplingParams(max_tokens=5, n=2), "n2")
    leader = Sequence(request, 0)
    sibling = Sequence(request, 1, leader=leader)
    request.sequences += [leader, sibling]
    scheduler.add(leader)
    scheduler.add(sibling)
    batch = scheduler.schedule()
    assert batch.seqs == [leader]
    complete(scheduler, batch)
    scheduler.publish(leader)
    batch = scheduler.schedule()
    assert sibling in batch.seqs if batch.kind == "prefill" else True
    while sibling.in_prefill or sibling.status is SequenceStatus.WAITING:
        batch = scheduler.schedule()
        if batch.kind == "prefill":
            assert batch.starts[batch.seqs.index(sibling)] == 8  # two shared pages of 4
        complete(scheduler, batch)
    assert sibling.allocation.pages[:2] == leader.allocation.pages[:2]
    cache.check_integrity()


def test_prefill_token_budget_shortens_chunks_only_while_others_decode():
    pool = PagePool(512)
    config = SchedulerConfig([1, 4], [1, 4], block_seq_stride=4, max_seq_len=256, chunk_tokens=32,
                             prefill_token_budget=40)
    scheduler = Scheduler(config, PlainPagedAttentionCache(pool, 4))
    first = [seq(64, name=f"a{i}") for i in range(4)]
    for s in first:
        scheduler.add(s)
    batch = scheduler.schedule()  # nothing decodes yet: full chunks
    assert batch.kind == "prefill" and [len(c) for c in batch.chunks] == [32] * 4
    complete(scheduler, batch)
    batch = scheduler.schedule()
    complete(scheduler, batch)
    assert all(not s.in_prefill for s in first)
    later = [seq(64, name=f"b{i}") for i in range(4)]
    for s in later:
        scheduler.add(s)
    kinds = []
    for _ in range(2):
        batch = scheduler.schedule()
        kinds.append(batch.kind)
        if batch.kind == "prefill":
            # 40 tokens over 4 rows, whole pages of 4: 8 each
            assert [len(c) for c in batch.chunks] == [8] * 4
        complete(scheduler, batch)
    assert sorted(kinds) == ["decode", "prefill"]


def test_prefill_token_budget_never_splits_prompts_without_start_positions():
    config = SchedulerConfig([1, 4], [1, 4], block_seq_stride=4, max_seq_len=256, chunk_tokens=32,
                             prefill_token_budget=8, has_prefill_position=False)
    scheduler = Scheduler(config, PlainPagedAttentionCache(PagePool(512), 4))
    first = seq(20, name="first")
    scheduler.add(first)
    complete(scheduler, scheduler.schedule())
    assert not first.in_prefill  # it decodes now
    scheduler.add(seq(40, name="second"))
    batch = scheduler.schedule()
    assert batch.kind == "decode"  # the turns alternate
    complete(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.kind == "prefill" and [len(c) for c in batch.chunks] == [40]
