"""KServe v2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), with the
convention Triton's LLM backends use, so tritonclient, genai-perf and KServe clients work
unchanged: inputs `text_input` (BYTES), `stream` (BOOL), `sampling_parameters` (BYTES, a JSON
object of vLLM's sampling fields) and `exclude_input_in_output` (BOOL); output `text_output`
(BYTES). `ModelInfer` answers once; Triton's bidirectional `ModelStreamInfer` answers each
request with one response per piece of text (just one unless `stream` is true), the last
flagged with the `triton_final_response` parameter, and errors as `error_message` responses
so one bad request does not end the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import uuid
from dataclasses import fields

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from kiln.runtime.errors import InvalidRequestError, KilnError
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.service import GenerateService

from ..errors import failure_of
from ..generation import Generation, adapter_of, admit, check_limits
from ..metrics import Metrics
from ..prompts import encode
from ..settings import ServerSettings
from ..version import kiln_version
from .status import status_of

log = logging.getLogger("kiln.grpc")
SERVICE_NAME = "inference.GRPCInferenceService"
INPUTS = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL"}
OUTPUT = "text_output"
# A plain numeric type per datatype, for inputs sent as raw bytes.
_RAW_TYPES = {"BOOL": "?", "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "<u1",
              "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP32": "<f4", "FP64": "<f8"}
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def add_kserve_service(server, service: GenerateService, settings: ServerSettings, metrics: Metrics | None) -> str:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service, settings, metrics), server)
    return SERVICE_NAME


# -- tensors ------------------------------------------------------------------------------
def decode_bytes(raw: bytes) -> list[bytes]:
    """KServe's BYTES encoding: each element a 4-byte little-endian length, then its bytes."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidRequestError("a BYTES tensor's raw contents are cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidRequestError("a BYTES tensor's raw contents are cut short")
        items.append(raw[offset : offset + length])
        offset += length
    return items


def encode_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def request_inputs(request: pb.ModelInferRequest) -> dict[str, object]:
    """Each input's single value (the LLM convention: shape [1] or [1, 1]), raw or typed contents."""
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidRequestError("raw_input_contents must hold one entry per input")
    values = {}
    for index, tensor in enumerate(request.inputs):
        expected = INPUTS.get(tensor.name)
        if expected is None:
            raise InvalidRequestError(f"unknown input {tensor.name!r}: this model takes "
                                      f"{', '.join(INPUTS)}", param=tensor.name)
        if tensor.datatype != expected:
            raise InvalidRequestError(f"input {tensor.name} must be {expected}, got {tensor.datatype}",
                                      param=tensor.name)
        if request.raw_input_contents:
            raw = request.raw_input_contents[index]
            items = decode_bytes(raw) if expected == "BYTES" else np.frombuffer(raw, _RAW_TYPES[expected]).tolist()
        else:
            items = list(getattr(tensor.contents, _CONTENTS[expected]))
        if len(items) != 1:
            raise InvalidRequestError(f"input {tensor.name} must hold one element, got {len(items)}",
                                      param=tensor.name)
        values[tensor.name] = items[0]
    if "text_input" not in values:
        raise InvalidRequestError("the input text_input (BYTES) is required", param="text_input")
    return values


def sampling_params(given: bytes | None, settings: ServerSettings,
                    model_defaults: dict | None = None) -> SamplingParams:
    """`sampling_parameters`, vLLM's names; numbers may come as strings (Triton's examples send them so)."""
    try:
        fields_given = json.loads(given) if given else {}
    except RecursionError:
        raise InvalidRequestError("sampling_parameters is nested too deeply", param="sampling_parameters") from None
    except ValueError as error:
        raise InvalidRequestError(f"sampling_parameters is not JSON: {error}", param="sampling_parameters") from None
    if not isinstance(fields_given, dict):
        raise InvalidRequestError("sampling_parameters must be a JSON object", param="sampling_parameters")
    defaults = {f.name: f.default for f in fields(SamplingParams)}
    typed = {}
    for name, value in fields_given.items():
        kind = type(defaults.get(name))
        if isinstance(value, str) and kind in (int, float):
            try:
                value = kind(value)
            except ValueError:
                raise InvalidRequestError(f"sampling_parameters {name} must be a number, got {value!r}",
                                          param=name) from None
        elif isinstance(value, str) and kind is bool and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        typed[name] = value
    for internal in ("constraint", "diffusion", "pooling", "lora"):  # set by routes, never by a client's field
        if internal in typed:
            raise InvalidRequestError(f"unknown sampling parameters: {internal}", param=internal)
    params = SamplingParams.from_kwargs(model_defaults=model_defaults, **typed)
    check_limits(settings, params)  # every door's limits first, then this protocol's own
    if params.sequence_count != 1:
        raise InvalidRequestError("n and num_beams must be 1 here: one text_output per request", param="n")
    return params


def response(request: pb.ModelInferRequest, model: str, text: str, final: bool | None) -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name=model, model_version=request.model_version, id=request.id)
    out.outputs.add(name=OUTPUT, datatype="BYTES", shape=[1])
    out.raw_output_contents.append(encode_bytes([text.encode()]))
    if final is not None:
        out.parameters["triton_final_response"].bool_param = final
    return out


# -- the service --------------------------------------------------------------------------
class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: GenerateService, settings: ServerSettings, metrics: Metrics | None):
        self.service = service
        self.settings = settings
        self.metrics = metrics

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        await self._known(request.name, context)
        return pb.ModelReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kiln", version=kiln_version(), extensions=["generate"])

    async def ModelMetadata(self, request, context):
        await self._known(request.name, context)
        meta = pb.ModelMetadataResponse(name=request.name or self.settings.model_name, versions=["1"], platform="kiln")
        for name, datatype in INPUTS.items():
            meta.inputs.add(name=name, datatype=datatype, shape=[1])
        meta.outputs.add(name=OUTPUT, datatype="BYTES", shape=[-1])
        return meta

    async def ModelInfer(self, request, context):
        await self._known(request.model_name, context)
        try:
            inputs = request_inputs(request)
            if inputs.get("stream"):
                raise InvalidRequestError("stream true needs ModelStreamInfer (tritonclient's stream_infer)",
                                          param="stream")
            pieces = [text async for text in self._generate(request, inputs)]
        except KilnError as error:
            await context.abort(status_of(error), error.message)
        return response(request, request.model_name or self.settings.model_name, "".join(pieces), None)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests in, responses out as they come: each request runs in its own task."""
        responses: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def answer(request):
            try:
                inputs = request_inputs(request)
                model = request.model_name or self.settings.model_name
                pending = None  # hold one piece back, so the last carries the final flag
                async for text in self._generate(request, inputs):
                    if pending is not None:
                        await responses.put(pb.ModelStreamInferResponse(infer_response=response(
                            request, model, pending, False)))
                    pending = text
                await responses.put(pb.ModelStreamInferResponse(infer_response=response(
                    request, model, pending or "", True)))
            except KilnError as error:
                await responses.put(pb.ModelStreamInferResponse(error_message=error.message))
            except Exception as error:  # a bug of Kiln's: this request fails, the stream goes on
                log.exception("stream request failed")
                await responses.put(pb.ModelStreamInferResponse(error_message=f"internal error: {error}"))

        async def read():
            async for request in request_iterator:
                task = asyncio.ensure_future(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks))
            await responses.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await responses.get()) is not None:
                yield item
        finally:  # the client went away: every generation still running is aborted
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    # -- helpers ------------------------------------------------------------------------
    async def _generate(self, request, inputs):
        """The text pieces of one request: the prompt first unless excluded, then the
        completion, piece by piece when streaming, whole otherwise."""
        service, settings = self.service, self.settings
        admit(service, settings, request.model_name or None)
        raw = inputs["text_input"]
        if len(raw) > 4 * settings.max_prompt_chars:  # refused by size before anything decodes it
            raise InvalidRequestError(f"text_input has {len(raw)} bytes: the server tokenizes at most "
                                      f"{settings.max_prompt_chars} characters", param="text_input")
        prompt = raw.decode("utf-8", errors="replace")
        params = sampling_params(inputs.get("sampling_parameters"), settings, service.generation_defaults)
        params.lora = adapter_of(service, request.model_name or None)  # a LoRA adapter is a model here too
        stream = bool(inputs.get("stream"))
        ids = await encode(service, prompt, settings.max_prompt_chars, param="text_input")
        # The client's id is echoed, not used: Triton's clients may reuse one across requests.
        generation = await Generation(service, settings, self.metrics, [ids], [params], [uuid.uuid4().hex]).submit()
        text = "" if inputs.get("exclude_input_in_output") or stream else prompt
        async with contextlib.aclosing(generation.events()) as events:
            async for _, event in events:
                if (error := failure_of(event)) is not None:
                    raise error
                if stream:
                    if event.text or event.finish_reason:
                        yield event.text
                else:
                    text += event.text
        if not stream:
            yield text

    def _ready(self) -> bool:
        return self.service.state.value == "ready"

    async def _known(self, name: str, context) -> None:
        if not self.settings.knows_model(name) and adapter_of(self.service, name) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the model {name!r} does not exist: this server serves "
                                f"{', '.join(map(repr, self.settings.served_model_names))}")
