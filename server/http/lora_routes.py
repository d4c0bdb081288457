"""vLLM's routes for LoRA adapters at run time: load one from a PEFT directory under a name, or
unload it. A loaded adapter is a model: a request naming it in `model` runs with it, and
/v1/models lists it with its base. Behind the API key like every route; a build without adapter
slots answers 400.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kiln.runtime.errors import InvalidRequestError

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def registry(request: Request):
    service = request.app.state.service
    service.check_ready()
    if service.loras is None:
        raise InvalidRequestError("this model was built without LoRA adapter slots: build it with --max-loras N",
                                  param="lora_name")
    return service.loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request):
    loras = registry(request)
    if request.app.state.settings.knows_model(body.lora_name) and body.lora_name:
        raise InvalidRequestError(f"{body.lora_name!r} is the served model's name", param="lora_name")
    await asyncio.to_thread(loras.load, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request):
    registry(request).unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
