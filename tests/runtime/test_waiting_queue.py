"""The waiting queue: priority order, removal from anywhere, and an abort storm of 10,000 waiting
sequences that leaves the event loop free (each removal O(1), never a rebuild of the heap)."""

from __future__ import annotations

import asyncio
import time

from kiln.runtime import GenerateService, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.request import Request, Sequence
from kiln.runtime.waiting_queue import WaitingQueue
from tests.fake_program import FakeProgram


def sequences(count: int, priorities=None) -> list[Sequence]:
    out = []
    for i in range(count):
        request = Request([5, 6], SamplingParams(), f"r{i}", priority=priorities[i] if priorities else 0)
        out.append(Sequence(request, 0))
    return out


def test_served_by_priority_then_arrival_and_removed_from_anywhere():
    queue = WaitingQueue()
    seqs = sequences(6, priorities=[2, 0, 1, 0, 2, 1])
    for seq in seqs:
        queue.push(seq)
    queue.remove(seqs[3])
    queue.remove(seqs[3])  # twice: nothing more happens
    assert len(queue) == 5 and seqs[3] not in queue
    queue.push(seqs[3])  # back again, at its own place (its key is its priority and arrival)
    queue.remove(seqs[5])
    order = [queue.pop() for _ in range(len(queue))]
    assert order == [seqs[1], seqs[3], seqs[2], seqs[0], seqs[4]]
    assert not queue and queue.peek() is None


def test_stale_entries_are_swept_once_they_outnumber_the_waiting():
    queue = WaitingQueue()
    seqs = sequences(1000)
    for seq in seqs:
        queue.push(seq)
    for seq in seqs[:900]:
        queue.remove(seq)
    assert len(queue) == 100 and len(queue._heap) <= 2 * 100 + 1
    assert [queue.pop() for _ in range(100)] == seqs[900:]


def test_cancelling_ten_thousand_waiting_sequences_leaves_the_loop_free(fake_model_dir):
    """160 requests of n = 64 wait behind one running sequence; all are cancelled at once. The
    loop's longest stall while the batcher applies the aborts stays far below what a heap
    rebuild per sequence cost (seconds at this size)."""

    async def main():
        config = ServiceConfig(Artifacts.in_directory(fake_model_dir), max_running=1, max_queue=20_000)
        service = await GenerateService(config, program_factory=FakeProgram).start()
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=64)
        requests = [service.submit([5, 6, 7], params) for _ in range(160)]
        await asyncio.sleep(0.05)
        assert service.stats().waiting_requests >= 10_000
        stalls = []

        async def heartbeat():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                stalls.append(now - last)
                last = now

        beating = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.01)
        for request in requests:
            service.abort(request.request_id)
        while service.in_flight:
            await asyncio.sleep(0.005)
        beating.cancel()
        assert service.stats().waiting_requests == 0 and service.stats().pages_active == 0
        reasons = [event.finish_reason for r in requests for event in _drain(r)]
        assert len(reasons) == 160 * 64 and reasons.count("abort") >= 10_000  # each sequence ended, once
        await service.stop()
        return max(stalls)

    assert asyncio.run(main()) < 0.5


def _drain(request):
    events = []
    while not request.events.empty():
        event = request.events.get_nowait()
        if event.finish_reason:
            events.append(event)
    return events
