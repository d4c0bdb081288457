"""The page accounting of a model with sliding-window layers (runtime/kvcache/window_pool.py): a
sequence holds its sliding layers' pages for its window only, a cached prefix keeps them while room
allows, and a prefix is served only as far as its first query's window is on the device."""

from __future__ import annotations

import pytest

from kiln.runtime.config import PageGroups
from kiln.runtime.kvcache.plain_cache import PlainPagedAttentionCache
from kiln.runtime.kvcache.trie_cache import TriePagedAttentionCache
from kiln.runtime.kvcache.window_pool import WindowPagePool

STRIDE, WINDOW = 16, 32
# Gemma 3's shape in small: one group of global layers, two of sliding ones.
GROUPS = PageGroups(layers=((5,), (0,), (1,)), sliding=(False, True, True), window=WINDOW)


def pool(physical: int = 400, release: bool = True) -> WindowPagePool:
    return WindowPagePool(GROUPS, physical, physical + 1, release_windows=release)  # one global group: a page each


def cache_of(kind, pool: WindowPagePool, lazy: bool = False):
    return kind(pool, STRIDE, lazy_windows=lazy)


def held(pool: WindowPagePool) -> tuple[int, int]:
    """(global pages, sliding pages) backing a held page."""
    rows = pool.page_map[1:]
    return int((rows[:, 0] != 0).sum()), int((rows[:, 1:] != 0).sum())


def converse(cache, tokens: int, check=True) -> list[tuple[int, int]]:
    """A sequence prefilled with 40 tokens, then decoded a token a step to `tokens`, as the
    scheduler drives the cache; the pages backing it after each step."""
    prompt = list(range(100, 140))
    allocation = cache.acquire_pages_for_tokens(prompt, extra_token_slots=1)
    assert cache.extend_allocation(allocation, len(prompt))  # the prefill's blocks, as the scheduler asks
    cache.publish_allocated_pages(allocation, prompt)
    cache.advance(allocation, len(prompt))
    sequence, after = list(prompt), []
    while len(sequence) < tokens:
        assert cache.extend_allocation(allocation, len(sequence) + 1)
        sequence.append(7)
        cache.advance(allocation, len(sequence))
        after.append(held(cache.page_pool))
        if check:
            cache.check_integrity()
    return allocation, after


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("kind", [PlainPagedAttentionCache, TriePagedAttentionCache])
def test_a_long_conversation_holds_its_window_of_sliding_pages(kind, lazy):
    """Decoding to 640 tokens: a page per block in the global group, and in each sliding group only
    the blocks its next query may see (the window's 32 keys span at most three 16-token blocks)."""
    cache = cache_of(kind, pool(), lazy)
    allocation, after = converse(cache, 640)
    blocks = len(allocation.pages)
    assert blocks == 640 // STRIDE and after[-1][0] == blocks
    window_blocks = WINDOW // STRIDE + 1
    cached = 2 if kind is TriePagedAttentionCache else 0  # the prompt's two published pages keep theirs as cache
    assert max(sliding for _, sliding in after) <= 2 * (window_blocks + cached)
    cache.free_cache_pages(allocation)
    cache.check_integrity()


def test_a_cache_that_keeps_every_page_holds_the_whole_context():
    cache = PlainPagedAttentionCache(pool(release=False), STRIDE)
    allocation, after = converse(cache, 640)
    assert after[-1] == (len(allocation.pages), 2 * len(allocation.pages))
    cache.free_cache_pages(allocation)
    cache.check_integrity()
    assert held(cache.page_pool) == (0, 0)


def test_a_conversation_longer_than_the_pool_could_hold_whole_still_fits():
    """100 physical pages (33 blocks with every group) carry a 1,000-token conversation (63 blocks):
    only the global group grows with it."""
    cache = PlainPagedAttentionCache(pool(physical=100), STRIDE)
    allocation, after = converse(cache, 1000, check=False)
    cache.check_integrity()
    assert after[-1][0] == len(allocation.pages) == 63


def test_a_cached_prefix_is_served_while_its_window_pages_are_there():
    """A finished sequence's prompt pages stay cached with their sliding pages while room allows:
    the same prompt again starts after all its full pages. Once a fresh sequence has needed that
    room, a prefix is served only as far as the pages its first query may see still have them:
    here, not at all."""
    cache = TriePagedAttentionCache(pool(physical=40), STRIDE)
    prompt = list(range(200, 300))  # six full pages and four tokens
    first = cache.acquire_pages_for_tokens(prompt, extra_token_slots=1)
    cache.publish_allocated_pages(first, prompt)
    cache.advance(first, len(prompt))
    assert first.window_start == (len(prompt) - WINDOW + 1) // STRIDE == 4
    cache.free_cache_pages(first)
    cache.check_integrity()

    again = cache.acquire_pages_for_tokens(prompt)
    assert again.cached_tokens == 96 and again.window_start == 4
    cache.free_cache_pages(again)

    # 11 blocks, 33 pages: the 21 free and the cached prefix's 12 sliding pages.
    other = cache.acquire_pages_for_tokens(list(range(1000, 1100)), extra_token_slots=76)
    assert other is not None and held(cache.page_pool) == (6 + 11, 2 * 11)
    cache.check_integrity()
    cache.free_cache_pages(other)
    late = cache.acquire_pages_for_tokens(prompt)
    assert late.cached_tokens == 0  # blocks 4 and 5 lost their sliding pages: no start has its window
    cache.free_cache_pages(late)
    cache.check_integrity()


def test_a_prefix_starts_where_its_window_is_whole():
    """Pages 0-3 of a cached prefix without their sliding pages, 4 and 5 with them: a prompt
    starting after six pages sees only 4 and 5 (keys 65 on), so it is served all six."""
    cache = TriePagedAttentionCache(pool(), STRIDE)
    prompt = list(range(200, 300))
    first = cache.acquire_pages_for_tokens(prompt, extra_token_slots=1)
    cache.publish_allocated_pages(first, prompt)
    cache.advance(first, len(prompt))
    window_pool = cache.page_pool
    for page in first.pages[:4]:
        window_pool._drop_sliding(page)
    cache.check_integrity()
    again = cache.acquire_pages_for_tokens(prompt)
    assert again.cached_tokens == 96
    shorter = cache.acquire_pages_for_tokens(prompt[:90])  # five full pages: its window needs page 3
    assert shorter.cached_tokens == 0
    for allocation in (first, again, shorter):
        cache.free_cache_pages(allocation)
    cache.check_integrity()


def test_a_prompt_longer_than_the_pool_holds_whole_is_prefilled_a_chunk_at_a_time():
    """Sliding pages given as each 64-token chunk is about to be written (the scheduler's
    `extend_allocation` before the call) and let go as the window passes: a 1,000-token prompt
    (63 blocks, 189 pages whole) runs in 90 pages; with every page given at admission it cannot."""
    def sized():
        return WindowPagePool.sized(GROUPS, 30, STRIDE, 2048, step_tokens=64)

    assert sized().sequence_capacity == 7 + (90 - 7 * 3)  # 7 blocks watched at once, then global pages alone
    prompt = list(range(3000, 4000))
    assert TriePagedAttentionCache(sized(), STRIDE).acquire_pages_for_tokens(prompt) is None
    cache = TriePagedAttentionCache(sized(), STRIDE, lazy_windows=True)
    allocation = cache.acquire_pages_for_tokens(prompt)
    most = 0
    for end in range(64, len(prompt) + 64, 64):
        end = min(end, len(prompt))
        assert cache.extend_allocation(allocation, end)
        most = max(most, allocation.window_end - allocation.window_start)  # the blocks it watches
        cache.publish_allocated_pages(allocation, prompt[:end])
        cache.advance(allocation, end)
        cache.check_integrity()
    assert held(cache.page_pool)[0] == 63 and most <= 7  # the rest of the room keeps passed pages as cache
    cache.free_cache_pages(allocation)
    cache.check_integrity()
