"""Everything that touches a service's device runs on one thread: IREE's CUDA driver has its
context current only on the thread that opened the device, and a call's buffers allocated from
another thread fail (CUDA_ERROR_INVALID_CONTEXT). A program that records the threads it is
used from shows the rule holds without a GPU."""

from __future__ import annotations

import asyncio
import threading

from iree import runtime as ireert

from kiln.runtime import GenerateService, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.devices import open_devices
from tests.fake_program import FakeProgram, expected_greedy


class ThreadRecordingProgram(FakeProgram):
    def __init__(self, artifacts: Artifacts, device: str = "local-task", parameter_memory: str = "auto"):
        super().__init__(artifacts, device, parameter_memory)
        self.threads = {threading.get_ident()}

    def allocate_cache(self, pages: int):
        self.threads.add(threading.get_ident())
        return super().allocate_cache(pages)

    def call(self, name: str, *args):
        self.threads.add(threading.get_ident())
        return super().call(name, *args)


async def _serve_and_stop(fake_model_dir) -> tuple[set[int], list[list[int]]]:
    config = ServiceConfig(Artifacts.in_directory(fake_model_dir))
    service = await GenerateService(config, program_factory=ThreadRecordingProgram).start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 9]

    async def one(prompt):
        return [token for event in [e async for e in service.generate(prompt, params)] for token in event.token_ids]

    outputs = await asyncio.gather(*(one(prompt) for prompt in prompts))
    assert outputs == [expected_greedy(prompt, 6) for prompt in prompts]
    await service.stop()
    return service.program.threads, outputs


def test_a_service_opens_allocates_and_calls_its_device_on_one_thread(fake_model_dir):
    threads, _ = asyncio.run(_serve_and_stop(fake_model_dir))
    assert len(threads) == 1
    assert threading.get_ident() not in threads  # not the event loop's


def test_each_service_in_a_process_has_its_own_device_thread(fake_model_dir):
    first, _ = asyncio.run(_serve_and_stop(fake_model_dir))
    second, _ = asyncio.run(_serve_and_stop(fake_model_dir))
    assert len(first) == len(second) == 1


def test_gpu_devices_are_opened_afresh_and_cpu_devices_shared(monkeypatch):
    opened = []
    monkeypatch.setattr(ireert, "get_device", lambda uri, cache=True: opened.append((uri, cache)) or uri)
    open_devices("cuda", 1)
    open_devices("cuda://0", 1)
    open_devices("hip", 1)
    open_devices("local-task", 1)
    assert opened == [("cuda", False), ("cuda://0", False), ("hip", False), ("local-task", True)]
