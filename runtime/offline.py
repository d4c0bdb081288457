"""`LLM`: the runtime in-process, without HTTP, for scripts and `kiln generate`.

    from kiln.runtime import LLM, SamplingParams
    llm = LLM("path/to/artifacts")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))[0].text)
    vectors = llm.embed(["a query", "a document"])  # a build with --embeddings

It runs a GenerateService on a private event loop in a background thread, so
plain synchronous code can call it, and many prompts are batched together.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .contract import Artifacts
from .request import Completion
from .sampling import SamplingParams
from .service import GenerateService
from .service_config import ServiceConfig


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    completions: list[Completion]

    @property
    def text(self) -> str:
        return self.completions[0].text


class LLM:
    def __init__(self, artifacts: str | Path | Artifacts, target: str = "cpu", **service_options):
        if not isinstance(artifacts, Artifacts):
            artifacts = Artifacts.in_directory(Path(artifacts), target)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-llm", daemon=True)
        self._thread.start()
        self.service = GenerateService(ServiceConfig(artifacts, **service_options))
        self._call(self.service.start())

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def default_params(self) -> SamplingParams:
        """What a call without params samples with: the model's own defaults where it has them
        (as a request that sets no sampling field), else SamplingParams'."""
        return SamplingParams.from_kwargs(model_defaults=self.service.generation_defaults)

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None,
        add_special_tokens: bool = True,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) at once, with `params` or one SamplingParams
        per prompt (each may name its LoRA adapter, `lora`); results in prompt order."""
        params = params or self.default_params()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.service.encode(p, add_special_tokens) for p in prompts]
        each = params if isinstance(params, list) else [params] * len(ids)
        if len(each) != len(ids):
            raise ValueError(f"{len(each)} SamplingParams for {len(ids)} prompts")
        return self._call(self._generate_all(ids, each))

    def embed(self, prompts: list[str] | list[list[int]] | str, dimensions: int | None = None,
              add_special_tokens: bool = True) -> list[np.ndarray]:
        """One embedding per prompt (text or token ids), pooled as the model says (a build with
        embed functions: `--embeddings`); in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.service.encode(p, add_special_tokens) for p in prompts]
        return self._call(self.service.embed(ids, self.service.pooling(dimensions)))

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, add_special_tokens: bool = True):
        """Yield Events for one prompt as they are produced."""
        params = params or self.default_params()
        ids = prompt if isinstance(prompt, list) else self.service.encode(prompt, add_special_tokens)
        events: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            try:
                async for event in self.service.generate(ids, params):
                    events.put(event)
            except Exception as error:  # raised again in the caller's thread
                events.put(error)
            events.put(done)

        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        while (item := events.get()) is not done:
            if isinstance(item, Exception):
                raise item
            yield item

    async def _generate_all(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
        async def one(ids, params):
            completions = [Completion() for _ in range(params.n)]
            async for event in self.service.generate(ids, params):
                if event.error:
                    raise RuntimeError(event.error)
                completions[event.index].add(event)
            return GenerationResult(ids, completions)

        return list(await asyncio.gather(*(one(ids, p) for ids, p in zip(prompt_ids, params))))

    def close(self) -> None:
        """Stop the service and let go of it: its program, weights and KV cache are freed now,
        not when this object is (a `with LLM(...) as llm:` name outlives its block)."""
        if self._loop.is_running():
            self._call(self.service.stop(grace_seconds=0))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        self.service = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

