"""The scheduler's decisions, without a device: admission, alternation, chunks, preemption."""

from __future__ import annotations

from kiln.runtime.finishing import Finish, Stopping
from kiln.runtime.kvcache.page_pool import PagePool
from kiln.runtime.kvcache.plain_cache import PlainPagedAttentionCache
from kiln.runtime.kvcache.trie_cache import TriePagedAttentionCache
from kiln.runtime.batch import Phase
from kiln.runtime.request import Request, Sequence, SequenceState
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig
from tests.tiny_model import make_tiny_tokenizer

EOS = 2
# Where a sequence ends, as the batcher asks it of every token a step gives.
STOPPING = Stopping(make_tiny_tokenizer(), eos_token_ids=(EOS,), max_seq_len=256)


def config(prefill=(1, 4), decode=(1, 4), chunk=32, budget=0, has_prefill_position=True):
    return SchedulerConfig(tuple(prefill), tuple(decode), block_seq_stride=4, max_seq_len=256, chunk_tokens=chunk,
                           prefill_token_budget=budget, max_running=32, has_prefill_position=has_prefill_position)


def make(pages=64, chunk=32, trie=False, prefill=(1, 4), decode=(1, 4)):
    pool = PagePool(pages)
    cache = (TriePagedAttentionCache if trie else PlainPagedAttentionCache)(pool, 4)
    return Scheduler(config(prefill, decode, chunk), cache), cache


def seq(length, priority=0, name="r"):
    request = Request(list(range(10, 10 + length)), SamplingParams(max_tokens=50), name, priority=priority)
    sequence = Sequence(request, 0)
    request.sequences.append(sequence)
    STOPPING.add(request)
    return sequence


def complete(scheduler, batch, token=7):
    """A step's results applied as the batcher applies them: the K/V counted, then `token` (an
    int, or one per row) taken by every sampling row, which ends where Stopping says. One
    Finish (or None) per row."""
    tokens = [token] * batch.rows if isinstance(token, int) else token
    seqs = scheduler.sequences_of(batch)
    scheduler.written(batch)
    finishes = []
    for seq, samples, row_token in zip(seqs, batch.samples, tokens):
        finish = STOPPING.take(seq, row_token).finish if seq is not None and samples else None
        if finish is not None:
            scheduler.finish(seq, finish.reason)
        finishes.append(finish)
    return finishes


def names(scheduler, batch):
    return [s.request.request_id for s in scheduler.sequences_of(batch)]


def in_prefill(s):
    return s.state is SequenceState.PREFILL or s.state is SequenceState.WAITING


def test_priority_orders_admission():
    scheduler, _ = make(prefill=(1,))
    low, high, mid = seq(5, priority=5, name="low"), seq(5, priority=-1, name="high"), seq(5, priority=0, name="mid")
    for s in (low, high, mid):
        scheduler.add(s)
    order = []
    for _ in range(3):
        batch = scheduler.schedule()
        assert batch.phase is Phase.PREFILL
        order.append(names(scheduler, batch)[0])
        complete(scheduler, batch)
        # Nothing else: finish decoders so only prefills are compared.
        for s in list(scheduler.running):
            if s.state is SequenceState.DECODE:
                scheduler.finish(s, "length")
    assert order == ["high", "mid", "low"]


def test_prefill_and_decode_alternate_and_long_prompts_are_chunked():
    scheduler, cache = make(chunk=8)
    short, long_ = seq(3, name="short"), seq(30, name="long")
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch.phase is Phase.PREFILL and batch.tokens == ((10, 11, 12),) and batch.samples == (True,)
    complete(scheduler, batch)
    scheduler.add(long_)
    kinds, long_chunks = [], []
    while in_prefill(long_):
        batch = scheduler.schedule()
        kinds.append(batch.phase.value)
        if batch.phase is Phase.PREFILL:
            long_chunks.append(len(batch.tokens[0]))
            assert batch.samples == (batch.starts[0] + len(batch.tokens[0]) == 30,)
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
    while any(in_prefill(s) for s in seqs):
        complete(scheduler, scheduler.schedule())
    served = []
    for _ in range(6):
        batch = scheduler.schedule()
        assert batch.phase is Phase.DECODE and batch.batch_size == 2
        served += names(scheduler, batch)
        complete(scheduler, batch)
    assert sorted(served.count(name) for name in ("s0", "s1", "s2")) == [4, 4, 4]


def test_prefill_takes_as_many_rows_as_a_batch_size_they_fill():
    """A padding row costs a real row's compute: 2-3 ready prompts with sizes [1, 4] go one
    at a time, 4 or more fill a batch of 4."""
    scheduler, _ = make(prefill=(1, 4), decode=(16,))
    for i in range(3):
        scheduler.add(seq(5, name=f"a{i}"))
    sizes = []
    while (batch := scheduler.schedule()) is not None and batch.phase is Phase.PREFILL:
        sizes.append((batch.batch_size, batch.rows))
        complete(scheduler, batch)
        scheduler.last_phase = Phase.DECODE  # look at prefill decisions only
    assert sizes == [(1, 1), (1, 1), (1, 1)]
    scheduler, _ = make(prefill=(1, 4), decode=(16,))
    for i in range(5):
        scheduler.add(seq(5, name=f"b{i}"))
    batch = scheduler.schedule()
    assert (batch.batch_size, batch.rows) == (4, 4)


def test_the_youngest_is_preempted_and_recomputed_without_resampling():
    scheduler, cache = make(pages=5, chunk=64, prefill=(1, 2))  # 4 usable pages of 4 tokens
    old, young = seq(6, name="old"), seq(6, name="young")
    scheduler.add(old)
    scheduler.add(young)
    batch = scheduler.schedule()
    assert batch.phase is Phase.PREFILL and batch.rows == 2
    complete(scheduler, batch)  # both: 7 tokens in 2 pages each; the pool is empty
    for _ in range(2):  # positions 6 and 7 fit in those pages
        batch = scheduler.schedule()
        assert batch.rows == 2
        complete(scheduler, batch)
    batch = scheduler.schedule()  # position 8 needs a third page: only by preempting
    assert batch.phase is Phase.DECODE and names(scheduler, batch) == ["old"]
    assert young.state is SequenceState.WAITING and young.preemptions == 1 and young.computed == 0
    assert young.prefill_target == len(young.tokens) - 1
    scheduler.finish(old, "length")
    batch = scheduler.schedule()
    assert batch.phase is Phase.PREFILL and batch.seq_ids == (young.seq_id,) and batch.samples == (False,)
    assert batch.tokens == (tuple(young.tokens[:-1]),)
    complete(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.phase is Phase.DECODE and batch.starts == (len(young.tokens) - 1,)
    cache.check_integrity()


def test_a_sibling_waits_for_its_leader_and_reuses_its_pages():
    scheduler, cache = make(trie=True)
    request = Request(list(range(10, 19)), SamplingParams(max_tokens=5, n=2), "n2")
    leader = Sequence(request, 0)
    sibling = Sequence(request, 1, leader=leader)
    request.sequences += [leader, sibling]
    STOPPING.add(request)
    scheduler.add(leader)
    scheduler.add(sibling)
    batch = scheduler.schedule()
    assert batch.seq_ids == (leader.seq_id,)
    complete(scheduler, batch)
    while in_prefill(sibling):
        batch = scheduler.schedule()
        if batch.phase is Phase.PREFILL:
            assert batch.starts[batch.seq_ids.index(sibling.seq_id)] == 8  # two shared pages of 4
        complete(scheduler, batch)
    assert sibling.allocation.pages[:2] == leader.allocation.pages[:2]
    cache.check_integrity()


def test_prefill_token_budget_shortens_chunks_only_while_others_decode():
    pool = PagePool(512)
    scheduler = Scheduler(config(budget=40), PlainPagedAttentionCache(pool, 4))
    first = [seq(64, name=f"a{i}") for i in range(4)]
    for s in first:
        scheduler.add(s)
    batch = scheduler.schedule()  # nothing decodes yet: full chunks
    assert batch.phase is Phase.PREFILL and [len(c) for c in batch.tokens] == [32] * 4
    complete(scheduler, batch)
    batch = scheduler.schedule()
    complete(scheduler, batch)
    assert all(s.state is SequenceState.DECODE for s in first)
    later = [seq(64, name=f"b{i}") for i in range(4)]
    for s in later:
        scheduler.add(s)
    kinds = []
    for _ in range(2):
        batch = scheduler.schedule()
        kinds.append(batch.phase.value)
        if batch.phase is Phase.PREFILL:
            # 40 tokens over 4 rows, whole pages of 4: 8 each
            assert [len(c) for c in batch.tokens] == [8] * 4
        complete(scheduler, batch)
    assert sorted(kinds) == ["decode", "prefill"]


def test_prefill_token_budget_never_splits_prompts_without_start_positions():
    scheduler = Scheduler(config(budget=8, has_prefill_position=False), PlainPagedAttentionCache(PagePool(512), 4))
    first = seq(20, name="first")
    scheduler.add(first)
    complete(scheduler, scheduler.schedule())
    assert first.state is SequenceState.DECODE  # it decodes now
    scheduler.add(seq(40, name="second"))
    batch = scheduler.schedule()
    assert batch.phase is Phase.DECODE  # the turns alternate
    complete(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.phase is Phase.PREFILL and [len(c) for c in batch.tokens] == [40]


def test_states_move_waiting_prefill_decode_finished():
    scheduler, cache = make(chunk=8)
    s = seq(10)
    assert s.state is SequenceState.WAITING
    scheduler.add(s)
    batch = scheduler.schedule()
    assert s.state is SequenceState.PREFILL and batch.tokens == (tuple(range(10, 18)),)
    assert complete(scheduler, batch) == [None] and s.state is SequenceState.PREFILL  # one chunk of two
    complete(scheduler, scheduler.schedule())
    assert s.state is SequenceState.DECODE and s.tokens[-1] == 7
    scheduler.finish(s, "abort")
    assert s.state is SequenceState.FINISHED and s.finish_reason == "abort"
    assert cache.stats().active == 0
    cache.check_integrity()


def test_eos_stop_tokens_and_length_finish_and_free_pages():
    scheduler, cache = make()
    eos, stop_token, length, ignoring = seq(5, name="eos"), seq(5, name="stop"), seq(5, name="length"), seq(5, name="x")
    stop_token.request.params.stop_token_ids = [9]
    length.request.params.max_tokens = 2
    ignoring.request.params.ignore_eos = True
    for s in (eos, stop_token, length, ignoring):
        scheduler.add(s)
    batch = scheduler.schedule()
    assert batch.rows == 4
    finishes = complete(scheduler, batch, [EOS, 9, 5, EOS])
    assert finishes == [Finish("stop", 2), Finish("stop", 9), None, None]
    assert [s.state for s in (eos, stop_token, length, ignoring)] == [
        SequenceState.FINISHED, SequenceState.FINISHED, SequenceState.DECODE, SequenceState.DECODE]
    assert eos.tokens[-1] == 2  # appended, then finished
    batch = scheduler.schedule()
    assert names(scheduler, batch) == ["length", "x"]
    assert complete(scheduler, batch, [4, 4]) == [Finish("length"), None]
    assert length.state is SequenceState.FINISHED and len(length.output_ids) == 2
    assert len(scheduler.running) == 1
    scheduler.finish(ignoring, "abort")
    assert cache.stats().active == 0
    cache.check_integrity()


def test_rows_aborted_while_their_batch_ran_are_skipped():
    scheduler, cache = make(prefill=(1, 2))
    a, b = seq(5, name="a"), seq(5, name="b")
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.finish(a, "abort")
    assert scheduler.sequences_of(batch) == [None, b]
    assert complete(scheduler, batch, [3, 3]) == [None, None]
    assert a.tokens == list(range(10, 15)) and b.tokens[-1] == 3
    cache.check_integrity()


def test_a_requests_queue_time_ends_when_it_is_first_admitted():
    scheduler, _ = make(prefill=(1,))
    first, second = seq(5, name="first"), seq(5, name="second")
    for s in (first, second):
        scheduler.add(s)
    assert first.request.scheduled_at is None and first.request.arrived_at > 0
    complete(scheduler, scheduler.schedule())  # one prefill row: only the first is admitted
    admitted = first.request.scheduled_at
    assert admitted is not None and admitted >= first.request.arrived_at and second.request.scheduled_at is None
    scheduler.preempt(first)
    while first.state is SequenceState.WAITING:  # readmitted: its queue time stays the first wait
        complete(scheduler, scheduler.schedule())
    assert first.request.scheduled_at == admitted
