"""A prefix cache at page granularity: sequences that share a prompt prefix share its pages.

Each trie node holds one full page, keyed by the block_seq_stride tokens in it, so a
path from the root is a cached prefix. Finished sequences leave their published pages
behind; they are evicted, least recently used leaf first, only when the pool runs dry.
This is shortfin's trie cache and SGLang's radix cache with pages as the unit.

Page references: the trie holds one PagePool reference on every page it caches and each
live allocation holds one on every page it uses, so a cached page's pool refcount is
1 + node.ref_count and a private (unpublished) page's is 1.

With a host tier (host_tier.HostKvTier), a node may hold its page on the device, in a host
slot, or both. Evicting a device page then keeps its K/V in host memory (copied at publish
with write-through, at eviction with write-back); a prompt that matches host-only nodes gets
device pages for them and a copy back, instead of recomputing them. Device pages stay a
prefix-closed set (a node on the device has its parent there too): the device evicts only
nodes with no child on the device, and a match restores from the first host-only node down.
Host slots are reclaimed least recently used first: a host-only leaf leaves the trie, a
node on the device just loses its copy. With a disk tier (disk_tier.DiskKvStore) under it,
pages read from files come in as host-only nodes (`disk_plan`, `insert_from_disk`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .base import BasePagedAttentionCache, CacheStats, PageAllocation
from .disk_tier import DiskKvStore, DiskPage
from .events import BlockStored, BlocksRemoved, KvEventLog, block_hash, chained_pages
from .host_tier import HostKvTier
from .page_pool import PagePool


@dataclass(eq=False)
class TrieNode:
    key: tuple[int, ...]  # the block_seq_stride tokens whose K/V the page holds
    page: int  # its device page; 0 while it lives only in the host tier
    parent: TrieNode | None  # None for the root and for evicted nodes
    children: dict[tuple[int, ...], TrieNode] = field(default_factory=dict)
    ref_count: int = 0  # live allocations whose prefix runs through this node
    last_access: int = 0  # the cache's logical clock, not wall time, so eviction is deterministic
    block_hash: int | None = None  # its identity in KV events and on disk (None for the root)
    host_slot: int | None = None  # its copy in the host tier, if any
    device_children: int = 0  # children whose page is on the device
    from_disk: bool = False  # read from the disk tier and not used since (its first use is a disk hit)


@dataclass(eq=False)
class _TrieHandle:
    """What an allocation holds in the trie: the path of nodes its first pages are.

    allocation.pages[:len(nodes)] are the nodes' pages; the rest are private to it.
    """

    nodes: list[TrieNode] = field(default_factory=list)


class TriePagedAttentionCache(BasePagedAttentionCache):
    shares_prefixes = True

    def __init__(self, page_pool: PagePool, block_seq_stride: int, host: HostKvTier | None = None,
                 events: KvEventLog | None = None, lazy_windows: bool = False):
        """`host`: the host tier below the device's pages; `events`: where the pages it stores
        and drops are told, for cache-aware routers; `lazy_windows`: as the base class says."""
        super().__init__(page_pool, block_seq_stride, lazy_windows)
        self.host = host
        self.root = TrieNode(key=(), page=0, parent=None)
        self._clock = 0
        # Candidate leaves for eviction: (last_access, tie-breaker, node). Entries go stale
        # when a node is used again or evicted; they are checked and skipped when popped.
        self._eviction_heap: list[tuple[int, int, TrieNode]] = []
        # Nodes holding a host slot, the same way: the host tier's reclaim order.
        self._host_heap: list[tuple[int, int, TrieNode]] = []
        self._heap_pushes = 0
        # Counters so stats() and the "can eviction make room" test need no trie walk;
        # check_integrity recomputes them from scratch.
        self._node_count = 0  # nodes whose page is on the device
        self._unreferenced_node_count = 0  # of those, the ones no allocation uses
        self._host_node_count = 0  # nodes holding a host slot
        self._private_page_count = 0
        self._hit_tokens = 0
        self._host_hit_tokens = 0
        # Live allocations by identity, so check_integrity can account for private pages.
        self._live: dict[int, PageAllocation] = {}
        self.events = events
        # The disk tier under the host tier (pages saved as their host copies are made); None: off.
        self.disk: DiskKvStore | None = None
        self._disk_hit_tokens = 0

    # --- the interface ---------------------------------------------------------------

    def acquire_pages_for_tokens(self, tokens: list[int], extra_token_slots: int = 0) -> PageAllocation | None:
        stride = self.block_seq_stride
        # The model must compute at least the last token to produce its logits.
        matchable_pages = max(0, (len(tokens) - 1) // stride)
        matched: list[TrieNode] = []  # on the device
        restoring: list[TrieNode] = []  # in the host tier only: below every matched node
        node = self.root
        while len(matched) + len(restoring) < matchable_pages:
            start = (len(matched) + len(restoring)) * stride
            node = node.children.get(tuple(tokens[start : start + stride]))
            if node is None:
                break
            (restoring if node.page == 0 else matched).append(node)
        if self.windowed is not None:  # no host tier here: every node matched is on the device
            matched = matched[: self._servable(matched)]

        # Reference the matched path (and what it restores) before evicting, so eviction cannot take it,
        # and watch the pages in the first query's window, so that a fresh page cannot take their place.
        self._reference(matched)
        window_start = 0
        if self.windowed is not None:  # pages the prefix cache kept whole: nothing to give them
            window_start = self.window_start_for(len(matched) * stride)
            watched = self.windowed.watch([node.page for node in matched[window_start:]])
            assert watched, "a servable prefix's window lost its pages"
        now = self._tick()
        for node in restoring:
            node.ref_count += 1
            node.last_access = now
        pages = self._acquire_private(self.pages_for(len(tokens) + extra_token_slots) - len(matched))
        if pages is None:
            if self.windowed is not None:
                self.windowed.unwatch([node.page for node in matched[window_start:]])
            self._unreference(matched)
            for node in restoring:
                node.ref_count -= 1
                self._push_host(node)
            return None
        from_disk = sum(node.from_disk for node in restoring)
        for node, page in zip(restoring, pages):
            self._restore(node, page)
        private_pages = pages[len(restoring) :]

        cached_tokens = (len(matched) + len(restoring)) * stride
        allocation = PageAllocation(
            pages=[node.page for node in matched + restoring] + private_pages,
            cached_tokens=cached_tokens,
            handle=_TrieHandle(nodes=matched + restoring),
            window_start=window_start,
            window_end=len(matched) if self.windowed is not None else 0,
        )
        self._live[id(allocation)] = allocation
        if (self.windowed is not None and not self.lazy_windows
                and not self._open_window(allocation, len(allocation.pages))):
            self.free_cache_pages(allocation)
            return None
        self._hit_tokens += len(matched) * stride
        self._host_hit_tokens += (len(restoring) - from_disk) * stride
        self._disk_hit_tokens += from_disk * stride
        return allocation

    def _servable(self, matched: list[TrieNode]) -> int:
        """How many of the matched nodes a prompt may start after: as many as leave every page its
        first query may see in a sliding layer still holding that layer's K/V."""
        pool, hit = self.windowed, len(matched)
        while hit and not all(pool.has_window(node.page) for node in matched[self.window_start_for(
                hit * self.block_seq_stride) : hit]):
            hit -= 1
        return hit

    def _restore(self, node: TrieNode, page: int) -> None:
        """A host-only node gets back a device page (fresh, its one reference the trie's) and
        its K/V copied into it before the next step; the allocation restoring it uses it."""
        node.page = page
        node.from_disk = False
        self.page_pool.retain([page])  # the allocation's reference, beside the trie's
        self.host.copy_to_device(node.host_slot, page)
        node.parent.device_children += 1
        self._node_count += 1
        self._private_page_count -= 1
        self._push_host(node)

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
            if self.events is not None or self.disk is not None:
                node.block_hash = block_hash(parent.block_hash, key)
            if self.events is not None:
                self.events.emit(BlockStored(node.block_hash, parent.block_hash, key, stride))
            self.page_pool.retain([node.page])  # the trie's own reference
            parent.device_children += 1
            path.append(node)
            self._node_count += 1
            self._private_page_count -= 1
            if self.host is not None and self.host.write_through:
                self._copy_to_host(node)
            parent = node

    def free_cache_pages(self, allocation: PageAllocation) -> None:
        if allocation.released:
            return
        self._leave_window(allocation)
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
            host_total=self.host.slot_count if self.host is not None else 0,
            host_used=self._host_node_count,
            host_hit_tokens=self._host_hit_tokens,
            disk_hit_tokens=self._disk_hit_tokens,
        )

    def evict_all_unreferenced(self) -> int:
        """Drop every cached page no sequence uses; returns how many (for tests and resets)."""
        return self._evict(self._unreferenced_node_count)

    def clear_unreferenced(self) -> int:
        """Every node no allocation uses leaves the trie, its device page and host slot freed
        (vLLM's reset_prefix_cache, SGLang's flush_cache); returns how many nodes went. A
        referenced node's ancestors are referenced too, so what goes is whole subtrees."""
        dropped = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.ref_count:
                    stack.append(child)
                    continue
                subtree = [child]
                for gone in subtree:  # grows as it goes: the child and all below it
                    subtree.extend(gone.children.values())
                    if gone.page != 0:
                        self.page_pool.release([gone.page])
                        gone.page = 0
                        self._node_count -= 1
                        self._unreferenced_node_count -= 1
                node.device_children = sum(c.page != 0 for c in node.children.values())
                dropped += len(subtree)
                self._drop_subtree(child)
        return dropped

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
            self._push_host(node)
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
            self._push_host(node)
        self.page_pool.release([node.page for node in path])

    def _make_room(self) -> bool:
        return self._evict(1) > 0

    def _release_private(self, pages: list[int]) -> None:
        self.page_pool.release(pages)
        self._private_page_count -= len(pages)

    def _acquire_private(self, count: int) -> list[int] | None:
        """`count` fresh pages, evicting cached ones if the free list is short; None if impossible."""
        shortfall = count - self.page_pool.available_count
        if shortfall > self._unreferenced_node_count:
            return None  # evicting everything evictable would not be enough: evict nothing
        if shortfall > 0:
            self._evict(shortfall)
            # A window pool's evicted page may free less than a fresh page takes (its sliding
            # layers' pages gone already): evict on while that is so.
            while self.page_pool.available_count < count and self._evict(1):
                pass
        pages = self.page_pool.acquire(count)
        if pages is not None:
            self._private_page_count += count
        return pages

    def _push_if_evictable(self, node: TrieNode) -> None:
        """Onto the device's eviction heap: a node on the device that nothing uses and that has no
        child on the device (without a host tier: no child at all)."""
        if node.ref_count != 0 or node.device_children or node.parent is None or node.page == 0:
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
            self._heap_entry(node) for node in self._iter_nodes()
            if node.ref_count == 0 and not node.device_children and node.page != 0
        ]
        heapq.heapify(self._eviction_heap)

    def _evict(self, page_count: int) -> int:
        """Free up to `page_count` device pages, least recently used first, from nodes with no
        child on the device: into the host tier when there is one, else out of the trie."""
        evicted = 0
        while evicted < page_count and self._eviction_heap:
            last_access, _, node = heapq.heappop(self._eviction_heap)
            if (node.parent is None or node.ref_count or node.device_children or node.page == 0
                    or node.last_access != last_access):
                continue  # stale entry: evicted, in use, a child on the device, or used since
            parent = node.parent
            if self.host is not None and node.host_slot is None:
                self._copy_to_host(node)  # write-back (or a write-through copy that found no slot)
            self.page_pool.release([node.page])  # the trie's reference was the last one
            node.page = 0
            parent.device_children -= 1
            self._node_count -= 1
            self._unreferenced_node_count -= 1
            evicted += 1
            if node.host_slot is None:
                self._drop_subtree(node)
            else:
                self._push_host(node)
            self._push_if_evictable(parent)
        return evicted

    def _drop_subtree(self, node: TrieNode) -> None:
        """Take a node that is no longer on the device, and its descendants (host-only, by the
        prefix-closed rule), out of the trie, freeing their host slots."""
        parent = node.parent
        del parent.children[node.key]
        removed = []
        stack = [node]
        while stack:
            gone = stack.pop()
            stack.extend(gone.children.values())
            gone.children = {}
            gone.parent = None
            if gone.host_slot is not None:
                self.host.free_slot(gone.host_slot)
                gone.host_slot = None
                self._host_node_count -= 1
            if gone.block_hash is not None:
                removed.append(gone.block_hash)
        if self.events is not None and removed:
            self.events.emit(BlocksRemoved(tuple(removed)))
        if parent.page == 0 and parent.parent is not None:
            self._push_host(parent)  # a host-only parent may have become a leaf

    # --- the host tier ---------------------------------------------------------------------

    def _copy_to_host(self, node: TrieNode) -> None:
        """Give a node on the device a host slot and queue the copy; without a free slot, the
        least recently used one is reclaimed, and failing that the node stays without a copy."""
        slot = self._take_host_slot()
        if slot is None:
            return
        node.host_slot = slot
        self._host_node_count += 1
        self.host.copy_to_host(node.page, slot, node)
        self._push_host(node)

    def _take_host_slot(self) -> int | None:
        while (slot := self.host.take_slot()) is None:
            if not self._reclaim_host_slot():
                return None
        return slot

    def _reclaim_host_slot(self) -> bool:
        """Free the least recently used host slot that may go: a host-only leaf nothing is
        restoring leaves the trie; a node on the device only loses its copy."""
        while self._host_heap:
            last_access, _, node = heapq.heappop(self._host_heap)
            if node.parent is None or node.host_slot is None or node.last_access != last_access:
                continue  # stale: gone, no slot any more, or used since
            if node.page != 0:
                self.host.free_slot(node.host_slot)
                node.host_slot = None
                self._host_node_count -= 1
                return True
            if node.ref_count == 0 and not node.children:
                self._drop_subtree(node)
                return True
        return False

    # --- the disk tier ---------------------------------------------------------------------

    def disk_plan(self, tokens: list[int]) -> tuple[TrieNode, list[DiskPage]]:
        """Where the trie's match for `tokens` ends, and the pages after it a prompt could reuse
        (all but the one holding its last token), named as their files are."""
        stride = self.block_seq_stride
        matchable_pages = max(0, (len(tokens) - 1) // stride)
        node, depth = self.root, 0
        while depth < matchable_pages:
            child = node.children.get(tuple(tokens[depth * stride : (depth + 1) * stride]))
            if child is None:
                break
            node, depth = child, depth + 1
        return node, [DiskPage(*page) for page in chained_pages(tokens, stride, depth, matchable_pages,
                                                                node.block_hash)]

    def insert_from_disk(self, parent: TrieNode, pages: list[DiskPage], data: list) -> int:
        """Pages read from disk become host-only nodes under `parent` (their K/V filled into host
        slots before the next step); returns how many went in. Stops where the trie changed
        meanwhile (the parent evicted) or no host slot is left."""
        inserted = 0
        for page, values in zip(pages, data):
            if parent is not self.root and parent.parent is None:
                break  # evicted while the files were read
            existing = parent.children.get(page.tokens)
            if existing is not None:  # computed meanwhile: go on below it
                parent = existing
                continue
            slot = self._take_host_slot()
            if slot is None or (parent is not self.root and parent.parent is None):
                if slot is not None:
                    self.host.free_slot(slot)
                break
            node = TrieNode(key=page.tokens, page=0, parent=parent, last_access=self._tick(),
                            block_hash=page.block_hash, host_slot=slot, from_disk=True)
            parent.children[page.tokens] = node
            self._host_node_count += 1
            self.host.fill(slot, values)
            self._push_host(node)
            if self.events is not None:
                self.events.emit(BlockStored(node.block_hash, page.parent_hash, page.tokens, self.block_seq_stride))
            parent = node
            inserted += 1
        return inserted

    def cached_path(self, tokens: list[int]) -> list[TrieNode]:
        """The nodes holding `tokens`' full pages, in any tier, as far as the trie has them."""
        stride, node, path = self.block_seq_stride, self.root, []
        for index in range(len(tokens) // stride):
            node = node.children.get(tuple(tokens[index * stride : (index + 1) * stride]))
            if node is None:
                break
            path.append(node)
        return path

    def keep_on_host(self, node: TrieNode) -> None:
        """Give a cached page on the device a host copy now, whatever the write policy."""
        if node.host_slot is None and node.page != 0:
            self._copy_to_host(node)

    def disk_pages_of(self, tokens: list[int]) -> list[DiskPage]:
        """The files `tokens`' full pages are (or would be) saved as."""
        return [DiskPage(*page) for page in chained_pages(tokens, self.block_seq_stride)]

    def disk_pages(self, copied: list[tuple[TrieNode, int]]) -> list[tuple[DiskPage, int]]:
        """Of the host copies a flush just made, those still a node's: each page to save and its slot."""
        return [(DiskPage(node.block_hash, node.parent.block_hash, node.key), slot) for node, slot in copied
                if node is not None and node.host_slot == slot and node.parent is not None
                and node.block_hash is not None]

    def _push_host(self, node: TrieNode) -> None:
        if self.host is None or node.host_slot is None or node.parent is None:
            return
        heapq.heappush(self._host_heap, self._heap_entry(node))
        if len(self._host_heap) > 2 * self._host_node_count + 64:
            self._host_heap = [self._heap_entry(n) for n in self._iter_nodes() if n.host_slot is not None]
            heapq.heapify(self._host_heap)

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
        on_device = [node for node in nodes if node.page != 0]
        unreferenced = 0
        for node in nodes:
            parent = node.parent
            assert parent is not None and parent.children.get(node.key) is node, "broken parent link"
            assert len(node.key) == self.block_seq_stride, f"node key {node.key} is not one page long"
            assert node.ref_count >= 0, f"node {node.key} has ref_count {node.ref_count}"
            assert node.device_children == sum(child.page != 0 for child in node.children.values()), (
                f"node {node.key}: device_children {node.device_children} is wrong")
            if node.page == 0:  # in the host tier only
                assert self.host is not None and node.host_slot is not None, f"node {node.key} is nowhere"
                assert node.ref_count == 0 and node.device_children == 0, f"host-only node {node.key} is in use"
                continue
            claim(node.page, f"trie node {node.key}")
            assert parent is self.root or parent.page != 0, "a node is on the device but its parent is not"
            if node.ref_count > 0:
                assert parent is self.root or parent.ref_count > 0, "a used node's parent is unused"
            else:
                unreferenced += 1
            assert pool.refcounts[node.page] == 1 + node.ref_count, (
                f"page {node.page}: pool refcount {pool.refcounts[node.page]}, node ref_count {node.ref_count}"
            )
        if self.host is not None:
            slots = [node.host_slot for node in nodes if node.host_slot is not None]
            assert self._host_node_count == len(slots), "host node counter drifted"
            self.host.check_integrity(slots)
            host_entries = {(id(node), last_access) for last_access, _, node in self._host_heap}
            for node in nodes:
                if node.host_slot is not None and (node.page != 0 or not node.children):
                    assert (id(node), node.last_access) in host_entries, f"node {node.key}'s slot cannot be reclaimed"

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

        # Every evictable node can be found by eviction.
        heap_entries = {(id(node), last_access) for last_access, _, node in self._eviction_heap}
        for node in on_device:
            if node.ref_count == 0 and not node.device_children:
                assert (id(node), node.last_access) in heap_entries, f"leaf {node.key} is missing from the heap"

        self._check_windows(self._live.values())
        assert self._node_count == len(on_device), "node counter drifted"
        assert self._unreferenced_node_count == unreferenced, "unreferenced counter drifted"
        assert self._private_page_count == private, "private page counter drifted"
        stats = self.stats()
        assert stats.free + stats.cached + stats.active == stats.total, f"pages leaked: {stats}"
        assert len(page_owner) + pool.free_count == pool.total, "a page is held by nobody"
