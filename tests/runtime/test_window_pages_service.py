"""A model with sliding-window layers served over pages that let those layers' blocks go
(runtime/kvcache/window_pool.py): multi-turn conversations that outgrow the window give the greedy
tokens of a cache that keeps every page and of no prefix cache at all, reusing prefixes meanwhile."""

from __future__ import annotations

import pytest

from kiln.runtime.kvcache.window_pool import WindowPagePool
from tests.conftest import _export_and_compile
from tests.export.test_families_e2e import EXPORT_ARGS
from tests.hf_families import write_family_checkpoint
from tests.runtime.test_host_tier_service import DEVICE_PAGES, conversations, page_bytes_of

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma3_artifacts(tmp_path_factory):
    """The tiny Gemma 3 (local layers with a 6-token window beside global ones), pages of 16 tokens."""
    directory = write_family_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-hf"))
    return _export_and_compile(directory, tmp_path_factory.mktemp("gemma3-artifacts"), EXPORT_ARGS)


def test_conversations_over_window_pages_match_a_cache_keeping_every_page(gemma3_artifacts):
    windowed, stats, _ = conversations(artifacts=gemma3_artifacts)
    recomputed, _, _ = conversations(artifacts=gemma3_artifacts, prefix_sharing="none")
    page_bytes = page_bytes_of(gemma3_artifacts)
    # A host tier copies blocks whole: the sliding layers' pages are all kept under it.
    kept, host_stats, _ = conversations(artifacts=gemma3_artifacts, host_kv_bytes=4 * DEVICE_PAGES * page_bytes)
    assert windowed == recomputed == kept
    assert stats.prefix_hit_tokens > 0 and host_stats.host_hit_tokens > 0


def test_the_service_lets_a_sliding_layers_pages_go(gemma3_artifacts):
    import asyncio

    from kiln.runtime import SamplingParams
    from tests.runtime.test_service import collect, started

    async def go():
        service = await started(gemma3_artifacts, page_count=DEVICE_PAGES)
        try:
            pool = service.pool
            assert isinstance(pool, WindowPagePool) and pool.release_windows
            # 200 tokens, 13 blocks: every group's page of each would be 26 of the pool's 48 pages.
            [out] = await collect(service, list(range(5, 105)), SamplingParams(max_tokens=100, temperature=0,
                                                                               ignore_eos=True))
            assert len(out["ids"]) == 100
            sliding = int((pool.page_map[:, 1] != 0).sum())  # the sliding group's pages still held
            assert sliding <= 100 // 16  # the prompt's pages, kept as prefix cache; none of the decode's
            return pool
        finally:
            await service.stop()

    asyncio.run(go())


def test_rejected_drafts_never_cost_a_window_its_pages(gemma3_artifacts, tiny_artifacts):
    """Drafts of another model (the tiny Llama, the same tokenizer), most of them rejected, over 150
    greedy tokens: a verify call writes a row's drafts, so the window moves only past the token
    certain to stay; the tokens are those of plain decoding."""
    import asyncio

    from kiln.runtime import SamplingParams
    from kiln.runtime.contract import Artifacts
    from kiln.runtime.service_config import SpeculativeConfig
    from tests.runtime.test_service import collect, started

    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)

    async def run(**options):
        service = await started(gemma3_artifacts, **options)
        try:
            [out] = await collect(service, prompt, params)
            service.cache.check_integrity()
            return out["ids"], service.speculator.counters if service.speculator is not None else None
        finally:
            await service.stop()

    plain, _ = asyncio.run(run())
    drafting = SpeculativeConfig("draft_model", 4, Artifacts.in_directory(tiny_artifacts), disable_by_batch_size=0)
    drafted, counters = asyncio.run(run(speculative=drafting))
    assert drafted == plain
    assert counters.draft_tokens > counters.accepted_tokens
