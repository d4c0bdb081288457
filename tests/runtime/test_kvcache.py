"""KV-cache managers: page accounting, prefix sharing, eviction, and a randomized stress run.

Every scenario ends with check_integrity(), which recomputes the accounting from scratch.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kiln.runtime.config import PageGroups
from kiln.runtime.kvcache.base import PageAllocation
from kiln.runtime.kvcache.host_tier import HostKvTier
from kiln.runtime.kvcache.page_pool import PagePool
from kiln.runtime.kvcache.plain_cache import PlainPagedAttentionCache
from kiln.runtime.kvcache.trie_cache import TriePagedAttentionCache
from kiln.runtime.kvcache.window_pool import WindowPagePool

PAGE_COUNT = 17  # 16 usable: page 0 is reserved
STRIDE = 4
USABLE = PAGE_COUNT - 1


def make_cache(kind: str):
    cache_class = {"plain": PlainPagedAttentionCache, "trie": TriePagedAttentionCache}[kind]
    return cache_class(PagePool(PAGE_COUNT), STRIDE)


@pytest.fixture(params=["plain", "trie"])
def cache(request):
    cache = make_cache(request.param)
    yield cache
    cache.check_integrity()


@pytest.fixture
def trie():
    cache = make_cache("trie")
    yield cache
    cache.check_integrity()


def assert_balanced(cache) -> None:
    stats = cache.stats()
    assert stats.free + stats.cached + stats.active == stats.total == USABLE
    cache.check_integrity()


def tokens_of(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def share_prefix(cache, tokens: list[int]) -> None:
    """A finished sequence that leaves `tokens`' full pages in the cache."""
    allocation = cache.acquire_pages_for_tokens(tokens)
    cache.publish_allocated_pages(allocation, tokens)
    cache.free_cache_pages(allocation)


# --- both implementations ------------------------------------------------------------


def test_acquire_and_free(cache):
    allocation = cache.acquire_pages_for_tokens(tokens_of(100, 10), extra_token_slots=2)
    assert len(allocation.pages) == 3 and len(set(allocation.pages)) == 3
    assert allocation.cached_tokens == 0
    assert cache.stats().active == 3 and cache.stats().free == USABLE - 3
    assert_balanced(cache)

    cache.free_cache_pages(allocation)
    cache.free_cache_pages(allocation)  # idempotent
    assert allocation.released
    assert cache.stats().free == USABLE and cache.stats().active == 0
    assert_balanced(cache)


def test_page_0_is_never_handed_out(cache):
    allocations = [cache.acquire_pages_for_tokens([7, 7]) for _ in range(USABLE)]
    pages = [page for allocation in allocations for page in allocation.pages]
    assert sorted(pages) == list(range(1, PAGE_COUNT))
    assert cache.acquire_pages_for_tokens([7]) is None
    assert_balanced(cache)
    for allocation in allocations:
        cache.free_cache_pages(allocation)
    assert_balanced(cache)


def test_acquire_that_cannot_fit_holds_nothing(cache):
    held = cache.acquire_pages_for_tokens(tokens_of(0, 4 * 10))
    before = cache.stats()
    assert cache.acquire_pages_for_tokens(tokens_of(500, 4 * 7)) is None
    assert cache.stats() == before
    assert_balanced(cache)
    cache.free_cache_pages(held)


def test_extend_across_page_boundary(cache):
    allocation = cache.acquire_pages_for_tokens(tokens_of(0, 4))
    assert len(allocation.pages) == 1
    assert cache.extend_allocation(allocation, 4) and len(allocation.pages) == 1
    assert cache.extend_allocation(allocation, 5) and len(allocation.pages) == 2
    assert cache.extend_allocation(allocation, 12) and len(allocation.pages) == 3
    assert_balanced(cache)

    pages_before = list(allocation.pages)
    assert not cache.extend_allocation(allocation, 4 * (USABLE + 1))
    assert allocation.pages == pages_before
    assert_balanced(cache)
    cache.free_cache_pages(allocation)
    assert cache.stats().free + cache.stats().cached == USABLE


def test_no_leaks_over_a_busy_sequence_of_requests(cache):
    live: list[PageAllocation] = []
    for step in range(40):
        tokens = tokens_of(step % 3 * 1000, 5 + step % 9)
        allocation = cache.acquire_pages_for_tokens(tokens, extra_token_slots=step % 4)
        if allocation is not None:
            cache.publish_allocated_pages(allocation, tokens)
            live.append(allocation)
        if len(live) > 3:
            cache.free_cache_pages(live.pop(0))
        assert_balanced(cache)
    for allocation in live:
        cache.free_cache_pages(allocation)
    assert cache.stats().active == 0
    assert_balanced(cache)


# --- prefix sharing (trie) -----------------------------------------------------------


def test_prefix_hit_returns_the_same_pages(trie):
    prompt = tokens_of(0, 10)
    first = trie.acquire_pages_for_tokens(prompt)
    trie.publish_allocated_pages(first, prompt)  # 2 full pages

    second = trie.acquire_pages_for_tokens(prompt[:8] + [99, 98, 97])
    assert second.cached_tokens == 8
    assert second.pages[:2] == first.pages[:2]
    assert second.pages[2] != first.pages[2]
    assert trie.page_pool.refcounts[first.pages[0]] == 3  # the trie and both sequences
    assert trie.stats().hit_tokens == 8
    assert_balanced(trie)

    trie.free_cache_pages(first)
    trie.free_cache_pages(second)
    assert trie.stats().cached == 2 and trie.stats().active == 0
    assert_balanced(trie)


def test_partial_prefix_match_stops_at_the_first_differing_page(trie):
    share_prefix(trie, tokens_of(0, 12))
    allocation = trie.acquire_pages_for_tokens(tokens_of(0, 4) + [50, 51, 52, 53] + tokens_of(8, 5))
    assert allocation.cached_tokens == 4
    trie.free_cache_pages(allocation)
    assert_balanced(trie)


def test_hit_leaves_at_least_one_token_to_compute(trie):
    prompt = tokens_of(0, 8)  # exactly two full pages
    share_prefix(trie, prompt)
    assert trie.stats().cached == 2

    allocation = trie.acquire_pages_for_tokens(prompt)
    assert allocation.cached_tokens == STRIDE  # not 2 * STRIDE: the last token must be computed
    assert len(allocation.pages) == 2
    assert trie.stats().active == 2 and trie.stats().cached == 1
    assert_balanced(trie)
    trie.free_cache_pages(allocation)

    one_more = trie.acquire_pages_for_tokens(prompt + [42])
    assert one_more.cached_tokens == 2 * STRIDE
    trie.free_cache_pages(one_more)
    assert_balanced(trie)


def test_publish_is_idempotent_and_grows_with_the_sequence(trie):
    tokens = tokens_of(0, 6)
    allocation = trie.acquire_pages_for_tokens(tokens, extra_token_slots=10)
    trie.publish_allocated_pages(allocation, tokens)  # after prefill: one full page
    trie.publish_allocated_pages(allocation, tokens)
    assert trie.page_pool.refcounts[allocation.pages[0]] == 2
    after_prefill = trie.stats()

    tokens = tokens_of(0, 13)
    trie.publish_allocated_pages(allocation, tokens)  # at finish: three full pages
    trie.publish_allocated_pages(allocation, tokens)
    assert trie.stats() == after_prefill  # publishing moves pages between kinds of "active"
    assert all(trie.page_pool.refcounts[page] == 2 for page in allocation.pages[:3])
    assert trie.page_pool.refcounts[allocation.pages[3]] == 1
    assert_balanced(trie)

    trie.free_cache_pages(allocation)
    assert trie.stats().cached == 3 and trie.stats().free == USABLE - 3
    assert_balanced(trie)


def test_publish_only_covers_allocated_pages(trie):
    allocation = trie.acquire_pages_for_tokens(tokens_of(0, 4))
    trie.publish_allocated_pages(allocation, tokens_of(0, 12))
    trie.free_cache_pages(allocation)
    assert trie.stats().cached == 1
    assert_balanced(trie)


def test_conflicting_publish_keeps_the_later_pages_private(trie):
    share_prefix(trie, tokens_of(0, 4))  # both sequences will hit this page
    tokens = tokens_of(0, 13)
    first = trie.acquire_pages_for_tokens(tokens)
    second = trie.acquire_pages_for_tokens(tokens)
    assert first.cached_tokens == second.cached_tokens == 4
    assert first.pages[1:] != second.pages[1:]

    trie.publish_allocated_pages(first, tokens)
    trie.publish_allocated_pages(second, tokens)  # page 1 conflicts: publish nothing more
    assert all(trie.page_pool.refcounts[page] == 1 for page in second.pages[1:])
    assert len(second.handle.nodes) == 1
    assert_balanced(trie)

    trie.free_cache_pages(first)
    trie.free_cache_pages(second)
    assert trie.stats().cached == 3 and trie.stats().active == 0
    assert_balanced(trie)


def test_publish_retries_after_the_conflicting_page_is_evicted(trie):
    tokens = tokens_of(0, 9)
    first = trie.acquire_pages_for_tokens(tokens)
    second = trie.acquire_pages_for_tokens(tokens)
    trie.publish_allocated_pages(first, tokens)
    trie.free_cache_pages(first)
    trie.publish_allocated_pages(second, tokens)
    assert second.handle.nodes == []

    assert trie.evict_all_unreferenced() == 2
    trie.publish_allocated_pages(second, tokens)
    assert [node.page for node in second.handle.nodes] == second.pages[:2]
    trie.free_cache_pages(second)
    assert_balanced(trie)


# --- eviction (trie) -----------------------------------------------------------------


def test_eviction_takes_least_recently_used_prefixes_first(trie):
    prefixes = {name: tokens_of(base, 8) for name, base in [("a", 0), ("b", 100), ("c", 200)]}
    for tokens in prefixes.values():
        share_prefix(trie, tokens)
    touched = trie.acquire_pages_for_tokens(prefixes["a"] + [1])  # "a" is now the most recent
    trie.free_cache_pages(touched)
    assert trie.stats().cached == 6 and trie.stats().free == USABLE - 6

    # Two more pages than are free: the two pages of "b", the least recently used, go.
    big = trie.acquire_pages_for_tokens(tokens_of(900, 4 * (USABLE - 6 + 2)))
    assert big is not None
    assert trie.stats().cached == 4
    assert_balanced(trie)
    trie.free_cache_pages(big)

    hits = {}
    for name, tokens in prefixes.items():
        probe = trie.acquire_pages_for_tokens(tokens + [1])
        hits[name] = probe.cached_tokens
        trie.free_cache_pages(probe)
    assert hits == {"a": 8, "b": 0, "c": 8}
    assert_balanced(trie)


def test_eviction_goes_leaf_first(trie):
    share_prefix(trie, tokens_of(0, 12))  # a chain of three pages
    big = trie.acquire_pages_for_tokens(tokens_of(900, 4 * (USABLE - 3 + 1)))
    assert big is not None and trie.stats().cached == 2
    probe = trie.acquire_pages_for_tokens(tokens_of(0, 13))
    assert probe is None  # 4 pages wanted, 2 of them cached, but nothing left free
    trie.free_cache_pages(big)
    probe = trie.acquire_pages_for_tokens(tokens_of(0, 13))
    assert probe.cached_tokens == 8  # the root-side pages survived
    trie.free_cache_pages(probe)
    assert_balanced(trie)


def test_eviction_never_takes_pages_in_use(trie):
    prompt = tokens_of(0, 9)
    share_prefix(trie, prompt)
    share_prefix(trie, tokens_of(100, 8))
    holder = trie.acquire_pages_for_tokens(prompt)  # references the two pages of `prompt`
    in_use = holder.pages[:2]
    free_or_evictable = trie.stats().free + trie.stats().cached
    assert free_or_evictable == USABLE - 3

    before = trie.stats()
    assert trie.acquire_pages_for_tokens(tokens_of(500, 4 * (free_or_evictable + 1))) is None
    assert trie.stats() == before  # nothing evicted for a request that could not fit anyway
    assert_balanced(trie)

    everything = trie.acquire_pages_for_tokens(tokens_of(500, 4 * free_or_evictable))
    assert everything is not None and trie.stats().free == 0 and trie.stats().cached == 0
    assert not set(in_use) & set(everything.pages)
    assert [node.page for node in holder.handle.nodes] == in_use
    assert_balanced(trie)

    trie.free_cache_pages(everything)
    trie.free_cache_pages(holder)
    assert_balanced(trie)


def test_failed_acquire_releases_its_prefix_match(trie):
    prompt = tokens_of(0, 8)
    share_prefix(trie, prompt)
    blocker = trie.acquire_pages_for_tokens(tokens_of(900, 4 * (USABLE - 2)))
    assert trie.acquire_pages_for_tokens(prompt + tokens_of(50, 8)) is None  # hits 2 pages, needs 2 more
    assert trie.stats().cached == 2 and trie.stats().active == USABLE - 2
    assert_balanced(trie)
    trie.free_cache_pages(blocker)
    allocation = trie.acquire_pages_for_tokens(prompt + [1])
    assert allocation.cached_tokens == 8
    trie.free_cache_pages(allocation)
    assert_balanced(trie)


def test_heavily_reused_prefix_keeps_the_eviction_heap_small(trie):
    prompt = tokens_of(0, 8)
    share_prefix(trie, prompt)
    for _ in range(500):  # each reuse leaves a stale heap entry behind
        trie.free_cache_pages(trie.acquire_pages_for_tokens(prompt + [1]))
    assert len(trie._eviction_heap) <= 2 * trie.stats().cached + 64
    assert_balanced(trie)
    assert trie.evict_all_unreferenced() == 2
    assert trie.stats().free == USABLE
    assert_balanced(trie)


def test_extend_evicts_cached_pages(trie):
    share_prefix(trie, tokens_of(0, 8))
    allocation = trie.acquire_pages_for_tokens(tokens_of(100, 4))
    assert trie.extend_allocation(allocation, 4 * USABLE)
    assert trie.stats().cached == 0 and trie.stats().free == 0
    assert not trie.extend_allocation(allocation, 4 * USABLE + 1)
    trie.free_cache_pages(allocation)
    assert_balanced(trie)


# --- randomized stress ---------------------------------------------------------------


HOST_SLOTS = 24


def make_host_cache(write_policy: str, slots: int = HOST_SLOTS) -> TriePagedAttentionCache:
    """A trie over PAGE_COUNT device pages with a host tier; a page's 'K/V' is its tokens."""
    return TriePagedAttentionCache(PagePool(PAGE_COUNT), STRIDE, HostKvTier(slots, STRIDE, np.int64, write_policy))


# A model with sliding layers in small (kvcache/window_pool.py): a global group and two sliding ones,
# an 8-token window (two pages).
WINDOW_GROUPS = PageGroups(layers=((1,), (0,), (2,)), sliding=(False, True, True), window=2 * STRIDE)


def make_window_cache(kind: str):
    """The cache over a window pool of the memory of USABLE whole blocks: letting sliding pages go,
    given as the blocks are about to be written ("windowed") or with their pages ("windowed_plain"),
    or keeping them below a host tier ("windowed_write_through")."""
    pool = WindowPagePool.sized(WINDOW_GROUPS, USABLE, STRIDE, 64, release_windows=kind != "windowed_write_through",
                                step_tokens=8)
    if kind == "windowed_plain":
        return PlainPagedAttentionCache(pool, STRIDE)
    host = None
    if kind == "windowed_write_through":
        host = HostKvTier(HOST_SLOTS, STRIDE * WINDOW_GROUPS.count, np.int64, "write_through", rows_of=pool.rows_of)
    return TriePagedAttentionCache(pool, STRIDE, host, lazy_windows=kind == "windowed")


@pytest.mark.parametrize("kind", ["plain", "trie", "write_through", "write_back", "windowed", "windowed_plain",
                                  "windowed_write_through"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_accounting_and_the_contents_right(kind, seed):
    """Random requests over a few shared prefixes, with a model of what each page holds.

    Besides the page accounting, this checks what prefix sharing must never get wrong:
    a cache hit serves pages holding exactly the prompt's tokens (copied back from the host
    tier, where there is one, as the batcher copies: between steps), and a sequence only
    ever writes into pages no one else is using.
    """
    rng = random.Random(seed)
    if kind.startswith("windowed"):
        cache = make_window_cache(kind)
    else:
        cache = make_cache(kind) if kind in ("plain", "trie") else make_host_cache(kind)
    host = getattr(cache, "host", None)
    pool = cache.page_pool
    windowed = isinstance(pool, WindowPagePool)
    prefixes = [[rng.randrange(6) for _ in range(16)] for _ in range(4 if host else 3)]
    device = np.full((pool.buffer_pages, STRIDE), -1, dtype=np.int64)  # the token whose K/V each slot holds

    def rows(page: int) -> list[int]:
        """The buffer's rows holding a page: one per group of a window pool, those it still has."""
        return [row for row in pool.rows_of(page) if row] if windowed else [page]
    live: list[tuple[PageAllocation, list[int], list[int]]] = []  # (allocation, tokens, [written count])
    expected_hits = 0

    def between_steps() -> None:
        if host is not None:
            host.flush(device)

    def write_pending(allocation: PageAllocation, tokens: list[int], written: list[int]) -> None:
        if not cache.extend_allocation(allocation, len(tokens)):  # as the scheduler does before a call
            return
        between_steps()
        for position in range(written[0], len(tokens)):
            page = allocation.pages[position // STRIDE]
            assert pool.refcounts[page] == 1, f"write into page {page}, which is shared"
            assert not windowed or pool.has_window(page), f"write into page {page}, whose window went"
            device[rows(page), position % STRIDE] = tokens[position]
        written[0] = len(tokens)
        cache.advance(allocation, written[0])

    for _ in range(2000):
        op = rng.random()
        if op < 0.35 or not live:
            prefix = rng.choice(prefixes)[: rng.randrange(17)]
            tokens = prefix + [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
            extra = rng.randrange(5)
            allocation = cache.acquire_pages_for_tokens(tokens, extra_token_slots=extra)
            if allocation is not None:
                between_steps()
                assert len(allocation.pages) == cache.pages_for(len(tokens) + extra)
                assert allocation.cached_tokens % STRIDE == 0 and allocation.cached_tokens < len(tokens)
                for position in range(allocation.cached_tokens):
                    page = allocation.pages[position // STRIDE]
                    assert device[rows(page)[0], position % STRIDE] == tokens[position], "a hit served wrong K/V"
                if windowed:  # every page the first query may see has its sliding layers' K/V
                    for page in allocation.pages[allocation.window_start : allocation.cached_tokens // STRIDE]:
                        assert pool.has_window(page) and (device[rows(page), :] == device[rows(page)[0], :]).all()
                expected_hits += allocation.cached_tokens
                live.append((allocation, tokens, [allocation.cached_tokens]))
        elif op < 0.65:  # one model step: write what is pending, then sample a token
            allocation, tokens, written = rng.choice(live)
            write_pending(allocation, tokens, written)
            if cache.extend_allocation(allocation, len(tokens) + 1):
                tokens.append(rng.randrange(6))
        elif op < 0.8:
            allocation, tokens, written = rng.choice(live)
            cache.publish_allocated_pages(allocation, tokens[: written[0]])
        else:
            allocation, tokens, written = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:  # finished normally: publish what was written
                cache.publish_allocated_pages(allocation, tokens[: written[0]])
            cache.free_cache_pages(allocation)
        cache.check_integrity()
        stats = cache.stats()
        assert stats.free + stats.cached + stats.active == stats.total
        assert stats.hit_tokens + stats.host_hit_tokens == expected_hits

    for allocation, _, _ in live:
        cache.free_cache_pages(allocation)
    if isinstance(cache, TriePagedAttentionCache):
        assert expected_hits > 0, "the stress run never hit the cache: it tests too little"
        cache.evict_all_unreferenced()
    if host is not None:
        assert cache.stats().host_hit_tokens > 0, "the host tier never served a page: it tests too little"
        assert host.counters.pages_to_device > 0 and host.counters.bytes_to_host > 0
    cache.check_integrity()
    assert cache.stats().free == pool.total


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_an_evicted_prefix_comes_back_from_host_memory(write_policy):
    cache = make_host_cache(write_policy)
    device = np.zeros((PAGE_COUNT, STRIDE), dtype=np.int64)
    prompt = list(range(1, 13))  # three pages
    first = cache.acquire_pages_for_tokens(prompt)
    device[first.pages] = np.array(prompt).reshape(3, STRIDE)
    cache.publish_allocated_pages(first, prompt)
    cache.free_cache_pages(first)
    cache.host.flush(device)
    assert cache.host.counters.pages_to_host == (3 if write_policy == "write_through" else 0)
    assert cache.evict_all_unreferenced() == 3
    cache.host.flush(device)
    device[:] = 0  # whatever the device pages held is gone
    assert cache.stats().host_used == 3 and cache.stats().cached == 0
    again = cache.acquire_pages_for_tokens(prompt + [13])
    assert again.cached_tokens == 12 and cache.stats().host_hit_tokens == 12
    cache.host.flush(device)
    assert device[again.pages[:3]].ravel().tolist() == prompt
    cache.free_cache_pages(again)
    cache.check_integrity()


def test_a_full_host_tier_reclaims_its_least_recently_used_pages():
    cache = make_host_cache("write_back", slots=4)
    for base in (100, 200, 300):  # three prefixes of two pages: the third pushes the first out
        prompt = list(range(base, base + 8))
        allocation = cache.acquire_pages_for_tokens(prompt)
        cache.publish_allocated_pages(allocation, prompt)
        cache.free_cache_pages(allocation)
        cache.evict_all_unreferenced()
        cache.check_integrity()
    assert cache.stats().host_used == 4
    assert cache.acquire_pages_for_tokens(list(range(100, 109))).cached_tokens == 0
    assert cache.acquire_pages_for_tokens(list(range(300, 309))).cached_tokens == 8
    cache.check_integrity()


def test_kv_events_report_pages_stored_and_evicted():
    from kiln.runtime.kvcache.events import BlocksRemoved, BlockStored, KvEventLog, block_hash

    log = KvEventLog()
    trie = TriePagedAttentionCache(PagePool(PAGE_COUNT), STRIDE, events=log)
    seen = []
    log.add_listener(lambda batch: seen.extend(batch.events))
    tokens = list(range(10, 20))  # two full pages and two tokens
    allocation = trie.acquire_pages_for_tokens(tokens)
    trie.publish_allocated_pages(allocation, tokens)
    first, second = seen
    assert isinstance(first, BlockStored) and first.token_ids == (10, 11, 12, 13) and first.parent_hash is None
    assert second.token_ids == (14, 15, 16, 17) and second.parent_hash == first.block_hash
    assert first.block_size == STRIDE and second.block_hash == block_hash(first.block_hash, (14, 15, 16, 17))
    assert block_hash(None, (10, 11, 12, 13)) == first.block_hash  # the same in any process
    trie.publish_allocated_pages(allocation, tokens)  # nothing new: no event
    assert len(seen) == 2
    trie.free_cache_pages(allocation)
    assert trie.evict_all_unreferenced() == 2
    assert seen[2:] == [BlocksRemoved((second.block_hash,)), BlocksRemoved((first.block_hash,))]  # leaf first
    batches = []
    subscription = log.subscribe(start=3)  # from the history: the batches numbered 3 on
    while not subscription.queue.empty():
        batches.append(subscription.queue.get_nowait())
    assert [b.sequence_number for b in batches] == [3, 4] and batches[0].events == (seen[2],)
    trie.check_integrity()


@pytest.mark.parametrize("write_policy", [None, "write_through", "write_back"])
def test_clearing_drops_every_unused_page_in_every_tier_and_keeps_those_in_use(write_policy):
    from kiln.runtime.kvcache.events import BlocksRemoved, KvEventLog

    log = KvEventLog()
    host = HostKvTier(HOST_SLOTS, STRIDE, np.int64, write_policy) if write_policy else None
    cache = TriePagedAttentionCache(PagePool(PAGE_COUNT), STRIDE, host, events=log)
    removed = []
    log.add_listener(lambda batch: removed.extend(e for e in batch.events if isinstance(e, BlocksRemoved)))
    device = np.zeros((PAGE_COUNT, STRIDE), dtype=np.int64)
    shared = tokens_of(1, 8)  # two pages, then a branch in use and a branch left behind
    in_use = cache.acquire_pages_for_tokens(shared + tokens_of(100, 5))
    cache.publish_allocated_pages(in_use, shared + tokens_of(100, 4))
    share_prefix(cache, shared + tokens_of(200, 8))
    share_prefix(cache, tokens_of(50, 12))  # a prefix no one uses, of three pages
    if host is not None:
        host.flush(device)
        cache.evict_all_unreferenced()  # some pages only in the host tier now
        host.flush(device)
        share_prefix(cache, tokens_of(50, 8))  # two of them back on the device, the third host-only
        host.flush(device)
    before = cache.stats()
    assert before.cached > 0
    dropped = cache.clear_unreferenced()
    after = cache.stats()
    assert after.cached == 0 and after.active == before.active
    assert after.host_used == (3 if write_policy == "write_through" else 0)  # copies of the pages in use
    assert after.free == USABLE - after.active
    assert dropped == 5 and sum(len(event.block_hashes) for event in removed) >= 5
    # What is in use stays, and still serves its prefix.
    again = cache.acquire_pages_for_tokens(shared + tokens_of(100, 4) + [7])
    assert again.cached_tokens == 12
    assert cache.acquire_pages_for_tokens(tokens_of(50, 9)).cached_tokens == 0
    cache.free_cache_pages(in_use)
    cache.check_integrity()
    assert make_cache("plain").clear_unreferenced() == 0
