"""Which replica probably holds which pages, and the choice of a replica for a request.

The table is what the front has sent where: each replica's page hashes, least recently
routed first out once a replica's share exceeds its KV cache's page count, a prefix's
deepest pages before its leading ones (its trie evicts least recently used leaves too, so
the two stay close). It is an estimate kept without
asking the replicas, as SGLang's and Ray's prefix-aware routers keep theirs.

The choice (SGLang's cache-aware policy, on pages): when the replicas' loads differ by more
than `imbalance` requests, the least loaded; otherwise the replica holding the longest
run of the request's leading pages, if that run is at least `min_match` of the prompt;
otherwise the replica holding the fewest pages, so new prefixes spread over the replicas.
Ties go to the least loaded.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class RoutingPolicy:
    name: str = "cache_aware"  # or "round_robin" (the baseline it is measured against)
    imbalance: int = 4  # in-flight requests between the busiest and the idlest replica
    min_match: float = 0.1  # the share of a prompt's pages a replica must hold to be preferred
    pages_per_replica: int = 4096  # how many page hashes the table keeps per replica

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.name!r}")


POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class RouteHint:
    """What the front tells the router of a request: its prompt's page hashes; a key to remember
    its replica by (a gRPC request id, a WebSocket session); or the key of an earlier request whose
    replica it must reach (an Abort, the session's next message)."""

    page_hashes: tuple[int, ...] = ()
    key: str | None = None
    follows: str | None = None


class PrefixTable:
    def __init__(self, pages_per_replica: int):
        self.pages_per_replica = pages_per_replica
        self._pages: dict[Hashable, collections.OrderedDict[int, None]] = {}

    def add_replica(self, replica: Hashable) -> None:
        self._pages.setdefault(replica, collections.OrderedDict())

    def remove_replica(self, replica: Hashable) -> None:
        self._pages.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._pages)

    def matched_pages(self, replica: Hashable, hashes: list[int]) -> int:
        """How many of `hashes`' leading pages the replica holds, up to the first it does not."""
        pages = self._pages.get(replica, {})
        count = 0
        while count < len(hashes) and hashes[count] in pages:
            count += 1
        return count

    def page_count(self, replica: Hashable) -> int:
        return len(self._pages.get(replica, ()))

    def record(self, replica: Hashable, hashes: list[int]) -> None:
        """The replica is about to cache these pages: they become its most recently used, the
        leading page last, so a prefix loses its deepest pages first, as the replica's trie
        evicts leaves first. (Leading page first out would end the prefix's match at page 0
        while the rest of it is still held.)"""
        pages = self._pages.setdefault(replica, collections.OrderedDict())
        for h in reversed(hashes):
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.pages_per_replica:
            pages.popitem(last=False)


def choose(policy: RoutingPolicy, table: PrefixTable, hashes: list[int], loads: dict[Hashable, int],
           turn: int = 0) -> list[Hashable]:
    """The replicas in order of preference for a request with these page hashes, given each
    candidate's in-flight requests (`turn` picks the round-robin's next replica)."""
    replicas = sorted(loads, key=str)
    if not replicas:
        return []
    if policy.name == "round_robin":
        first = turn % len(replicas)
        return replicas[first:] + replicas[:first]
    by_load = sorted(replicas, key=lambda r: loads[r])
    if max(loads.values()) - min(loads.values()) > policy.imbalance:
        return by_load
    matched = {r: table.matched_pages(r, hashes) for r in replicas}
    best = max(matched.values())
    if hashes and best >= max(1, policy.min_match * len(hashes)):
        return sorted(replicas, key=lambda r: (-matched[r], loads[r]))
    return sorted(replicas, key=lambda r: (table.page_count(r), loads[r]))
