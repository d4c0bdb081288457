"""A prefix cache at page granularity: sequences that share a prompt prefix share its pages.

Each trie node holds one full page, keyed by the block_seq_stride tokens in it, so a
path from the root is a cached prefix. Finished sequences leave their published pages
behind; they are evicted, least recently used leaf first, only when the pool runs dry.
This is shortfin's trie cache and SGLang's radix cache with pages as the unit.

Page references: the trie holds one PagePool reference on every page it caches and each
live allocation holds one on every page it uses, so a cached page's pool refcount is
1 + node.ref_count and a private (unpublished) page's is 1.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .base import BasePagedAttentionCache, CacheStats, PageAllocation
from .events import BlockStored, BlocksRemoved, block_hash
from .page_pool import PagePool


@dataclass(eq=False)
class TrieNode:
    key: tuple[int, ...]  # the block_seq_stride tokens whose K/V the page holds
    page: int
    parent: TrieNode | None  # None for the root and for evicted nodes
    children: dict[tuple[int, ...], TrieNode] = field(default_factory=dict)
    ref_count: int = 0  # live allocations whose prefix runs through this node
    last_access: int = 0  # the cache's logical clock, not wall time, so eviction is deterministic
    block_hash: int | None = None  # its identity in KV events (None for the root)


@dataclass(eq=False)
class _TrieHandle:
    """What an allocation holds in the trie: the path of nodes its first pages are.

    allocation.pages[:len(nodes)] are the nodes' pages; the rest are private to it.
    """

    nodes: list[TrieNode] = field(default_factory=list)


class TriePagedAttentionCache(BasePagedAttentionCache):
    shares_prefixes = True

    def __init__(self, page_pool: PagePool, block_seq_stride: int):
        super().__init__(page_pool, block_seq_stride)
        self.root = TrieNode(key=(), page=0, parent=None)
        self._clock = 0
        # Candidate leaves for eviction: (last_access, tie-breaker, node). Entries go stale
        # when a node is used again or evicted; they are checked and skipped when popped.
        self._eviction_heap: list[tuple[int, int, TrieNode]] = []
        self._heap_pushes = 0
        # Counters so stats() and the "can eviction make room" test need no trie walk;
        # check_integrity recomputes them from scratch.
        self._node_count = 0
        self._unreferenced_node_count = 0
        self._private_page_count = 0
        self._hit_tokens = 0
        # Live allocations by identity, so check_integrity can account for private pages.
        self._live: dict[int, PageAllocation] = {}
        # KV events (runtime.kvcache.events.KvEventLog) for cache-aware routers; None: off.
        self.events = None

    # --- the interface ---------------------------------------------------------------

    def acquire_pages_for_tokens(self, tokens: list[int], extra_token_slots: int = 0) -> PageAllocation | None:
        stride = self.block_seq_stride
        # The model must compute at least the last token to produce its logits.
        matchable_pages = max(0, (len(tokens) - 1) // stride)
        matched: list[TrieNode] = []
        node = self.root
        while len(matched) < matchable_pages:
            start = len(matched) * stride
            node = node.children.get(tuple(tokens[start : start + stride]))
            if node is None:
                break
            matched.append(node)

        # Reference the matched path before evicting, so eviction cannot take it.
        self._reference(matched)
        private_pages = self._acquire_private(self.pages_for(len(tokens) + extra_token_slots) - len(matched))
        if private_pages is None:
            self._unreference(matched)
            return None

        cached_tokens = len(matched) * stride
        self._hit_tokens += cached_tokens
        allocation = PageAllocation(
            pages=[node.page for node in matched] + private_pages,
            cached_tokens=cached_tokens,
            handle=_TrieHandle(nodes=matched),
        )
        self._live[id(allocation)] = allocation
        return allocation

    def publish_allocated_pages(self, allocation: PageAllocation, tokens: list[int]) -> None:
        """Insert the allocation's full, written pages under its deepest trie node.

        Stops at the first page whose tokens another sequence already published: past
        that point the trie path leads to the other sequence's pages, not ours, so our
        later pages cannot hang under it. That page stays private; a later call retries
        (if the other node was evicted meanwhile, ours goes in).
        """
        assert not allocation.released, "publish of a freed allocation"
        stride = self.block_seq_stride
        path = allocation.handle.nodes
        full_pages = min(len(tokens) // stride, len(allocation.pages))
        parent = path[-1] if path else self.root
        for index in range(len(path), full_pages):
            key = tuple(tokens[index * stride : (index + 1) * stride])
            if key in parent.children:
                return
            node = TrieNode(key=key, page=allocation.pages[index], parent=parent, ref_count=1, last_access=self._clock)
            parent.children[key] = node
            if self.events is not None:
                node.block_hash = block_hash(parent.block_hash, key)
                self.events.emit(BlockStored(node.block_hash, parent.block_hash, key, stride))
            self.page_pool.retain([node.page])  # the trie's own reference
            path.append(node)
            self._node_count += 1
            self._private_page_count -= 1
            parent = node

    def free_cache_pages(self, allocation: PageAllocation) -> None:
        if allocation.released:
            return
        allocation.released = True
        del self._live[id(allocation)]
        path = allocation.handle.nodes
        private_pages = allocation.pages[len(path) :]
        self._unreference(path)
        self.page_pool.release(private_pages)
        self._private_page_count -= len(private_pages)

    def stats(self) -> CacheStats:
        referenced_nodes = self._node_count - self._unreferenced_node_count
        return CacheStats(
            total=self.page_pool.total,
            free=self.page_pool.free_count,
            cached=self._unreferenced_node_count,
            active=referenced_nodes + self._private_page_count,
            hit_tokens=self._hit_tokens,
        )

    def evict_all_unreferenced(self) -> int:
        """Drop every cached page no sequence uses; returns how many (for tests and resets)."""
        return self._evict(self._unreferenced_node_count)

    # --- references and eviction -------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _reference(self, path: list[TrieNode]) -> None:
        """An allocation starts using `path` (a prefix from the root)."""
        now = self._tick()
        for node in path:
            if node.ref_count == 0:
                self._unreferenced_node_count -= 1
            node.ref_count += 1
            node.last_access = now
        self.page_pool.retain([node.page for node in path])

    def _unreference(self, path: list[TrieNode]) -> None:
        """An allocation stops using `path`; its pages count as used until now."""
        now = self._tick()
        for node in path:
            node.ref_count -= 1
            node.last_access = now
            if node.ref_count == 0:
                self._unreferenced_node_count += 1
                self._push_if_evictable(node)
        self.page_pool.release([node.page for node in path])

    def _acquire_private(self, count: int) -> list[int] | None:
        """`count` fresh pages, evicting cached ones if the free list is short; None if impossible."""
        shortfall = count - self.page_pool.free_count
        if shortfall > self._unreferenced_node_count:
            return None  # evicting everything evictable would not be enough: evict nothing
        if shortfall > 0:
            self._evict(shortfall)
        pages = self.page_pool.acquire(count)
        if pages is not None:
            self._private_page_count += count
        return pages

    def _push_if_evictable(self, node: TrieNode) -> None:
        if node.ref_count != 0 or node.children or node.parent is None:
            return
        heapq.heappush(self._eviction_heap, self._heap_entry(node))
        if len(self._eviction_heap) > 2 * self._node_count + 64:
            self._rebuild_eviction_heap()

    def _heap_entry(self, node: TrieNode) -> tuple[int, int, TrieNode]:
        # The ever-growing push counter breaks ties, so the heap never compares two nodes.
        self._heap_pushes += 1
        return (node.last_access, self._heap_pushes, node)

    def _rebuild_eviction_heap(self) -> None:
        """Drop the stale entries that pile up when cached prefixes are reused often."""
        self._eviction_heap = [
            self._heap_entry(node) for node in self._iter_nodes() if node.ref_count == 0 and not node.children
        ]
        heapq.heapify(self._eviction_heap)

    def _evict(self, page_count: int) -> int:
        """Free up to `page_count` cached pages, least recently used leaves first."""
        evicted = 0
        while evicted < page_count and self._eviction_heap:
            last_access, _, node = heapq.heappop(self._eviction_heap)
            if node.parent is None or node.ref_count or node.children or node.last_access != last_access:
                continue  # stale entry: evicted, in use, no longer a leaf, or used since
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.page_pool.release([node.page])  # the trie's reference was the last one
            self._node_count -= 1
            self._unreferenced_node_count -= 1
            evicted += 1
            self._push_if_evictable(parent)
            if self.events is not None and node.block_hash is not None:
                self.events.emit(BlocksRemoved((node.block_hash,)))
        return evicted

    def _iter_nodes(self):
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- checking ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        pool = self.page_pool
        pool.check_integrity()
        assert self.root.page == 0 and self.root.parent is None and self.root.ref_count == 0

        page_owner: dict[int, str] = {}  # page -> who holds it, to catch a page held twice

        def claim(page: int, owner: str) -> None:
            assert page != 0, f"page 0 held by {owner}"
            assert page not in page_owner, f"page {page} held by {page_owner[page]} and {owner}"
            page_owner[page] = owner

        nodes = list(self._iter_nodes())
        unreferenced = 0
        for node in nodes:
            claim(node.page, f"trie node {node.key}")
            parent = node.parent
            assert parent is not None and parent.children.get(node.key) is node, "broken parent link"
            assert len(node.key) == self.block_seq_stride, f"node key {node.key} is not one page long"
            assert node.ref_count >= 0, f"node {node.key} has ref_count {node.ref_count}"
            if node.ref_count > 0:
                assert parent is self.root or parent.ref_count > 0, "a used node's parent is unused"
            else:
                unreferenced += 1
            assert pool.refcounts[node.page] == 1 + node.ref_count, (
                f"page {node.page}: pool refcount {pool.refcounts[node.page]}, node ref_count {node.ref_count}"
            )

        # Each node's ref_count is exactly the number of live allocations running through it.
        uses: dict[int, int] = {}
        private = 0
        for allocation in self._live.values():
            assert not allocation.released, "a freed allocation is still live"
            path = allocation.handle.nodes
            assert allocation.pages[: len(path)] == [node.page for node in path], "pages disagree with trie path"
            parent = self.root
            for node in path:
                assert node.parent is parent, "an allocation's trie path is not a chain from the root"
                parent = node
                uses[id(node)] = uses.get(id(node), 0) + 1
            for page in allocation.pages[len(path) :]:
                claim(page, f"allocation {id(allocation)}")
                assert pool.refcounts[page] == 1, f"private page {page} has pool refcount {pool.refcounts[page]}"
                private += 1
        for node in nodes:
            assert node.ref_count == uses.get(id(node), 0), (
                f"node {node.key}: ref_count {node.ref_count}, used by {uses.get(id(node), 0)} allocations"
            )

        # Every evictable leaf can be found by eviction.
        heap_entries = {(id(node), last_access) for last_access, _, node in self._eviction_heap}
        for node in nodes:
            if node.ref_count == 0 and not node.children:
                assert (id(node), node.last_access) in heap_entries, f"leaf {node.key} is missing from the heap"

        assert self._node_count == len(nodes), "node counter drifted"
        assert self._unreferenced_node_count == unreferenced, "unreferenced counter drifted"
        assert self._private_page_count == private, "private page counter drifted"
        stats = self.stats()
        assert stats.free + stats.cached + stats.active == stats.total, f"pages leaked: {stats}"
        assert len(page_owner) + pool.free_count == pool.total, "a page is held by nobody"
