"""The host KV tier on the compiled tiny model: multi-turn conversations that outgrow the
device's pages come back from host memory, with the same greedy tokens as without the tier
and as with no prefix cache at all."""

from __future__ import annotations

import asyncio
import random

import pytest

from kiln.runtime import SamplingParams
from kiln.runtime.errors import ModelLoadError
from tests.runtime.test_service import assert_no_leaks, collect, started

pytestmark = pytest.mark.e2e

DEVICE_PAGES = 24  # about four conversations' worth: six do not fit
CONVERSATIONS, TURNS = 6, 3


def conversations(**options) -> tuple[list[list[int]], object, int]:
    """Each turn of each conversation (in turn order): its greedy output ids; the final stats;
    the host tier's page size (0 without one)."""

    async def go():
        service = await started(options.pop("artifacts"), page_count=DEVICE_PAGES, **options)
        rng = random.Random(3)
        histories = [[rng.randrange(1, 380) for _ in range(40)] for _ in range(CONVERSATIONS)]
        outputs = []
        try:
            for _ in range(TURNS):
                for history in histories:
                    history += [rng.randrange(1, 380) for _ in range(10)]  # the user's next message
                    [out] = await collect(service, list(history), SamplingParams(max_tokens=8, temperature=0,
                                                                                 ignore_eos=True))
                    outputs.append(out["ids"])
                    history += out["ids"]
                    assert_no_leaks(service)  # the pages account exactly across both tiers
            tier = service.kv_tiers.host if service.kv_tiers is not None else None
            return outputs, service.stats(), tier.page_bytes if tier is not None else 0
        finally:
            await service.stop()

    return asyncio.run(go())


def page_bytes_of(artifacts) -> int:
    async def go():
        service = await started(artifacts, host_kv_bytes=1 << 20)
        try:
            return service.kv_tiers.host.page_bytes
        finally:
            await service.stop()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def without_tier(tiny_artifacts):
    return conversations(artifacts=tiny_artifacts)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_conversations_come_back_from_host_memory_with_the_same_tokens(tiny_artifacts, without_tier, policy):
    page_bytes = page_bytes_of(tiny_artifacts)
    with_tier, stats, _ = conversations(artifacts=tiny_artifacts, host_kv_bytes=4 * DEVICE_PAGES * page_bytes,
                                        host_kv_write_policy=policy)
    recomputed, _, _ = conversations(artifacts=tiny_artifacts, prefix_sharing="none")
    assert with_tier == without_tier[0] == recomputed
    assert stats.host_pages_total == 4 * DEVICE_PAGES and stats.host_pages_used > 0
    assert stats.host_hit_tokens > 0  # real hits from host memory, each restored page copied once
    assert stats.bytes_to_device == stats.host_hit_tokens // 16 * page_bytes
    # More of each prompt was reused than the device alone could keep.
    assert stats.prefix_hit_tokens > without_tier[1].prefix_hit_tokens


def test_an_int8_caches_pages_come_back_from_host_memory_with_their_scales(tiny_int8_kv_artifacts):
    page_bytes = page_bytes_of(tiny_int8_kv_artifacts)
    without, _, _ = conversations(artifacts=tiny_int8_kv_artifacts)
    with_tier, stats, _ = conversations(artifacts=tiny_int8_kv_artifacts, host_kv_bytes=4 * DEVICE_PAGES * page_bytes)
    assert with_tier == without
    assert stats.host_hit_tokens > 0 and stats.bytes_to_device == stats.host_hit_tokens // 16 * page_bytes


def test_a_host_tier_needs_the_prefix_cache(tiny_artifacts):
    with pytest.raises(ModelLoadError, match="prefix-sharing trie"):
        asyncio.run(started(tiny_artifacts, prefix_sharing="none", host_kv_bytes=1 << 20))
    with pytest.raises(ModelLoadError, match="holds no page"):
        asyncio.run(started(tiny_artifacts, host_kv_bytes=10))
