"""KV-cache events: which pages the prefix cache now holds and which it dropped, for routers
that send a request to the replica already holding its prefix (vLLM's KV events, which
llm-d's KV-cache manager and the smg gateway consume).

The trie reports each page it publishes (with the tokens in it and its parent's hash, so a
consumer can rebuild the prefix) and each page it evicts; events raised during one turn of
the event loop go out together as one numbered batch. A subscriber reads batches from a
queue; one that falls too far behind is dropped and resumes from the history by number.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import struct
import time
from dataclasses import dataclass, field

MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device (routers expect it)


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """A page's identity: its tokens chained to its parent's hash, as a signed 64-bit integer
    (the width the events carry); the same in every process, unlike Python's hash()."""
    digest = hashlib.blake2b(struct.pack(f"<q{len(tokens)}I", parent or 0, *tokens), digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


def chained_pages(tokens: list[int], page_tokens: int, first: int = 0, end: int | None = None,
                  parent: int | None = None) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(block hash, parent's hash, tokens) of `tokens`' whole pages `first`..`end` (all by
    default), chained from `parent`, the hash of the page before `first` (None: the start)."""
    end = len(tokens) // page_tokens if end is None else end
    pages = []
    for index in range(first, end):
        key = tuple(tokens[index * page_tokens : (index + 1) * page_tokens])
        pages.append((block_hash(parent, key), parent, key))
        parent = pages[-1][0]
    return pages


@dataclass(frozen=True)
class BlockStored:
    block_hash: int
    parent_hash: int | None  # None: the page starts the sequence
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class CacheCleared:
    """Every page a subscriber knew of is gone (a fresh cache: the server started)."""


@dataclass(frozen=True)
class EventBatch:
    sequence_number: int  # 1, 2, ... per server run
    timestamp: float  # time.time()
    events: tuple


@dataclass(eq=False)
class Subscription:
    queue: asyncio.Queue
    dropped: bool = False  # fell behind by more than the queue holds: resubscribe from history
    _log: "KvEventLog | None" = field(default=None, repr=False)

    def close(self) -> None:
        if self._log is not None:
            self._log._subscribers.discard(self)


class KvEventLog:
    def __init__(self, history: int = 4096, queue_size: int = 4096):
        self._pending: list = []
        self._history: collections.deque[EventBatch] = collections.deque(maxlen=history)
        self._next = 1
        self._queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._listeners: list = []  # callables given every batch (publishers)
        self._flush_handle: asyncio.Handle | None = None

    def emit(self, event) -> None:
        self._pending.append(event)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the cache directly): one batch per event
            self.flush()
            return
        if self._flush_handle is None:
            self._flush_handle = loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_handle = None
        if not self._pending:
            return
        batch = EventBatch(self._next, time.time(), tuple(self._pending))
        self._next += 1
        self._pending = []
        self._history.append(batch)
        for subscription in list(self._subscribers):
            try:
                subscription.queue.put_nowait(batch)
            except asyncio.QueueFull:
                subscription.dropped = True
                self._subscribers.discard(subscription)
        for listener in self._listeners:
            listener(batch)

    def subscribe(self, start: int = 0) -> Subscription:
        """Batches from now on; with `start`, first those since that number still in the history."""
        subscription = Subscription(asyncio.Queue(self._queue_size), _log=self)
        if start:
            for batch in self._history:
                if batch.sequence_number >= start:
                    subscription.queue.put_nowait(batch)
        self._subscribers.add(subscription)
        return subscription

    def add_listener(self, listener) -> None:
        """Call `listener(batch)` for every batch: those in the history now, then each new one."""
        for batch in self._history:
            listener(batch)
        self._listeners.append(listener)
