"""vLLM's gRPC engine service (`vllm.grpc.engine.VllmEngine`, as smg-grpc-proto defines it):
what the Shepherd Model Gateway (smg) and vLLM's own gRPC clients speak to a worker. Token ids
in and out (the gateway tokenizes and detokenizes), streamed `Generate`, `Abort`, health, model
and server information, load, and the tokenizer's files; what Kiln cannot do (embeddings,
profiling, cache flushing) answers UNIMPLEMENTED saying so. With `--kv-events`,
`SubscribeKvEvents` streams the prefix cache's pages stored and evicted, for smg's cache-aware
routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import itertools
import json
import time
import uuid
import zipfile

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from kiln.runtime.errors import InvalidRequestError, KilnError
from kiln.runtime.grammar import Constraint
from kiln.runtime.kvcache.events import MEDIUM, BlockStored, BlocksRemoved, EventBatch
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.service import GenerateService

from ..generation import Generation, admit, rest_of_context
from ..metrics import Metrics
from ..prompts import encode
from ..settings import ServerSettings
from .status import status_of

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
TOKENIZER_CHUNK = 1 << 20
KV_EVENTS_HEARTBEAT = 1.0  # seconds between load records on an idle KV event stream


def add_vllm_engine_service(server, service: GenerateService, settings: ServerSettings,
                            metrics: Metrics | None) -> str:
    pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(service, settings, metrics), server)
    return SERVICE_NAME


def sampling_params(sp: pb.SamplingParams, prompt: list[int], service: GenerateService) -> SamplingParams:
    """The proto's fields as Kiln's: proto3 zeros mean "not set" where vLLM reads them so."""
    if sp.HasField("logprobs") and sp.logprobs < 0 or sp.HasField("prompt_logprobs") and sp.prompt_logprobs < 0:
        raise InvalidRequestError("logprobs of every token (-1) are not available: ask for at most 20",
                                  param="logprobs")
    return SamplingParams.from_kwargs(
        model_defaults=service.generation_defaults,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else rest_of_context(service, prompt),
        temperature=sp.temperature if sp.HasField("temperature") else None,
        top_p=sp.top_p or None, top_k=sp.top_k or None, min_p=sp.min_p or None,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty or None, min_tokens=sp.min_tokens,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, n=sp.n or None,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        seed=sp.seed if sp.HasField("seed") else None,
        logit_bias=dict(sp.logit_bias) or None, constraint=constraint(sp),
    )


def constraint(sp: pb.SamplingParams) -> Constraint | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            schema = json.loads(sp.json_schema)
        except ValueError as error:
            raise InvalidRequestError(f"json_schema is not JSON: {error}", param="json_schema") from None
        return Constraint.of("json", schema, "json_schema")
    if kind == "json_object":
        return Constraint.of("json_object", None, "json_object") if sp.json_object else None
    if kind == "choice":
        return Constraint.of("choice", list(sp.choice.choices), "choice")
    if kind in ("regex", "grammar"):
        return Constraint.of(kind, getattr(sp, kind), kind)
    raise InvalidRequestError(f"the {kind} constraint is not supported: use json_schema, regex, grammar, "
                              "json_object or choice", param=kind)


def output_logprobs(event) -> pb.OutputLogProbs | None:
    if not event.logprobs:
        return None
    out = pb.OutputLogProbs()
    for lp in event.logprobs:
        out.token_logprobs.append(lp.logprob)
        out.token_ids.append(lp.token_id)
        out.top_logprobs.add(values=list(lp.top.values()), token_ids=list(lp.top))
    return out


def kv_event_batch(batch: EventBatch) -> common_pb2.KvEventBatch:
    """A batch of the prefix cache's events in smg's schema; event ids number them within it."""
    out = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
    for event_id, event in enumerate(batch.events):
        if isinstance(event, BlockStored):
            stored = common_pb2.KvBlocksStored(medium=MEDIUM, blocks=[common_pb2.KvBlock(
                block_hash=event.block_hash, token_ids=event.token_ids, block_size=event.block_size)])
            if event.parent_hash is not None:
                stored.parent_block_hash = event.parent_hash
            out.events.add(event_id=event_id, stored=stored)
        elif isinstance(event, BlocksRemoved):
            out.events.add(event_id=event_id, removed=common_pb2.KvBlocksRemoved(block_hashes=event.block_hashes,
                                                                               medium=MEDIUM))
        else:
            out.events.add(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    return out


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, service: GenerateService, settings: ServerSettings, metrics: Metrics | None):
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self.started = time.time()
        self.last_request = 0.0

    async def Generate(self, request, context):
        service, settings = self.service, self.settings
        try:
            admit(service, settings, None)
            if request.WhichOneof("input") == "text":
                ids = await encode(service, request.text, settings.max_prompt_chars, param="text")
            else:
                ids = service.check_token_ids(request.tokenized.input_ids, param="input_ids")
            params = sampling_params(request.sampling_params, ids, service)
            generation = await Generation(service, settings, self.metrics, [ids], [params],
                                          [request.request_id or uuid.uuid4().hex]).submit()
        except KilnError as error:
            await context.abort(status_of(error), error.message)
        self.last_request = time.time()
        submitted = generation.requests[0]
        outputs: dict[int, list[int]] = {}
        # A cancelled call leaves this loop, and closing the events aborts the request.
        async with contextlib.aclosing(generation.events()) as events:
            async for _, event in events:
                tokens = outputs.setdefault(event.index, [])
                tokens.extend(event.token_ids)
                counts = {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                          "cached_tokens": submitted.cached_tokens}
                if request.stream and event.token_ids:
                    yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                        token_ids=event.token_ids, index=event.index, output_logprobs=output_logprobs(event),
                        **counts))
                if event.finish_reason:
                    complete = pb.GenerateComplete(output_ids=tokens, finish_reason=event.finish_reason,
                                                   index=event.index, **counts)
                    if isinstance(event.stop_reason, int):
                        complete.matched_token_id = event.stop_reason
                    elif isinstance(event.stop_reason, str):
                        complete.matched_stop_str = event.stop_reason
                    yield pb.GenerateResponse(complete=complete)

    async def Abort(self, request, context):
        for request_id in request.request_ids:
            self.service.abort(request_id)
        return pb.AbortResponse()

    async def HealthCheck(self, request, context):
        state = self.service.state.value
        return pb.HealthCheckResponse(healthy=state == "ready", message=state)

    async def GetModelInfo(self, request, context):
        service = await self._loaded(context)
        return pb.GetModelInfoResponse(
            model_path=str(service.artifacts.config.parent), is_generation=True,
            max_context_length=service.max_seq_len, vocab_size=service.vocab_size,
            served_model_name=self.settings.model_name, tokenizer_path=str(service.artifacts.tokenizer_path),
            model_type=service.model_type, eos_token_ids=service.eos_token_ids,
            pad_token_id=_or_none(service.special_token_id("pad_token")),
            bos_token_id=_or_none(service.special_token_id("bos_token")),
            max_req_input_len=service.max_seq_len - 1)

    async def GetServerInfo(self, request, context):
        service = await self._loaded(context)
        cache = service.program.params.paged_kv_cache
        return pb.GetServerInfoResponse(
            active_requests=service.in_flight, is_paused=service.state.value != "ready",
            last_receive_timestamp=self.last_request, uptime_seconds=time.time() - self.started,
            server_type="kiln-grpc", data_parallel_size=1, kv_cache_dtype=cache.kv_cache_dtype,
            block_size=service.cache.block_seq_stride, model_dtype=service.program.params.attn_dtype,
            max_num_seqs=service.config.max_running)

    async def GetLoads(self, request, context):
        service = await self._loaded(context)
        stats = service.stats()
        stride = service.cache.block_seq_stride
        used, capacity = stats.pages_active * stride, stats.pages_total * stride
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.running_sequences, num_waiting_reqs=stats.waiting_requests,
            num_total_reqs=service.in_flight, num_used_tokens=used, max_total_num_tokens=capacity,
            token_usage=used / capacity if capacity else 0.0,
            cache_hit_rate=stats.prefix_hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
            utilization=stats.running_sequences / service.config.max_running,
            max_running_requests=service.config.max_running)
        return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version="kiln",
                                   dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        """The tokenizer's files, zipped, in chunks; the SHA-256 of the zip on the last."""
        artifacts = (await self._loaded(context)).artifacts
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            tokenizer = artifacts.tokenizer_path
            for path in (tokenizer, tokenizer.with_name("tokenizer_config.json")):
                if path.is_file():
                    archive.write(path, path.name)
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK):
            last = start + TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start : start + TOKENIZER_CHUNK], sha256=digest if last else "")

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Kiln serves generative models: no embeddings")

    async def FlushCache(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Kiln's prefix cache evicts by itself; it has no flush")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Kiln has no profiler behind this call")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Kiln has no profiler behind this call")

    async def SubscribeKvEvents(self, request, context):
        """The prefix cache's KV events, batch by batch, from `start_sequence_number` while the
        history holds it; a subscriber that falls too far behind is told to resubscribe."""
        log = (await self._loaded(context)).kv_events
        if log is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "KV events are off: start the server with --kv-events")
        subscription = log.subscribe(request.start_sequence_number)
        samples = itertools.count(1)
        last = 0  # the last sequence number sent; load-only batches repeat it
        try:
            # A load record at once (gateways take a silent stream for a dead worker), then one
            # with every batch, and alone as a heartbeat while the cache has nothing to report.
            yield common_pb2.KvEventBatch(sequence_number=last, timestamp=time.time(),
                                          load=self._load(next(samples), load_only=True))
            while True:
                try:
                    batch = await asyncio.wait_for(subscription.queue.get(), KV_EVENTS_HEARTBEAT)
                except asyncio.TimeoutError:
                    yield common_pb2.KvEventBatch(sequence_number=last, timestamp=time.time(),
                                                  load=self._load(next(samples), load_only=True))
                    continue
                out = kv_event_batch(batch)
                out.load.CopyFrom(self._load(next(samples), load_only=False))
                last = batch.sequence_number
                yield out
                if subscription.dropped and subscription.queue.empty():
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this subscriber fell behind: "
                                        f"resubscribe from sequence {last + 1}")
        finally:
            subscription.close()

    def _load(self, sample: int, load_only: bool) -> common_pb2.EngineLoad:
        """The engine's load as GetLoads reports it, for a KV event stream."""
        service = self.service
        stats = service.stats()
        usage = stats.pages_active / stats.pages_total if stats.pages_total else 0.0
        return common_pb2.EngineLoad(running_requests=stats.running_requests, waiting_requests=stats.waiting_requests,
                                     token_usage=usage, active_token_usage=usage,
                                     max_running_requests=service.config.max_running, sample=sample,
                                     load_only=load_only)

    # -- helpers ------------------------------------------------------------------------
    async def _loaded(self, context) -> GenerateService:
        """The service, once its model is loaded (before that the information does not exist)."""
        if self.service.program is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading: retry shortly")
        return self.service


def _or_none(token_id: int | None) -> int:
    """The proto's way to say "no such token": -1."""
    return -1 if token_id is None else token_id
