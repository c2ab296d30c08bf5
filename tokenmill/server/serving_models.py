"""/v1/models, and the LoRA adapters the API serves: --lora-modules at start-up, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM). vLLM's
OpenAIServingModels, with its messages and statuses.

A request picks an adapter by its `model` (ServerState.check_model). Every load gets a new lora_int_id, the
adapter's identity in the engine (its KV blocks' hashes included), so a name unloaded and loaded again from other
weights never meets the old adapter's cache. The engine loads the adapter before the name is served: a bad path
or adapter is answered here (404 when the path holds no adapter, else 400), not by its first request. Unloading
takes the name off at once (its next request is a 404), while the requests already running with it finish."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from fastapi import FastAPI
from fastapi.responses import Response

from tokenmill.api.errors import LoRANotFound
from tokenmill.lora.request import LoRAModulePath, LoRARequest
from tokenmill.sampling_params import ParamError
from tokenmill.server import models_protocol as mp
from tokenmill.server.responses import json_response
from tokenmill.server.server_state import ServerState

logger = logging.getLogger("tokenmill.server")


class OpenAIServingModels:
    def __init__(self, state: ServerState):
        self.state = state
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken atomically

    def models(self) -> mp.ModelList:
        state, created = self.state, int(time.time())
        cards = [mp.ModelCard(name, created, state.model_root, state.engine.max_model_len)
                 for name in state.model_names]
        cards += [mp.ModelCard(lora.lora_name, created, lora.lora_path, state.engine.max_model_len,
                               parent=lora.base_model_name or state.model_names[0]) for lora in state.loras.values()]
        return mp.ModelList(cards)

    async def load_static(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules: each is loaded as the API would load it; raises on the first that fails."""
        for module in modules:
            await self.load(mp.LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path),
                            module.base_model_name)

    async def load(self, req: mp.LoadLoRAAdapterRequest, base_model_name: str | None = None) -> str:
        state = self.state
        if not req.lora_name or not req.lora_path:
            raise ParamError("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if not state.engine.max_loras:
            raise ParamError("this server serves no LoRA adapters: start it with --enable-lora", "lora_name")
        if req.lora_name in state.model_names or req.lora_name == state.model_root:
            raise ParamError(f"'{req.lora_name}' is the base model's name; give the adapter another", "lora_name")
        async with self._lock:
            old = state.loras.get(req.lora_name)
            if old is not None and not req.load_inplace:
                raise ParamError(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load "
                                 "the adapter in place, set 'load_inplace' to True.", "lora_name")
            if base_model_name is not None and base_model_name not in state.model_names:
                base_model_name = None  # vLLM's rule: a parent that is not a served model name is not reported
            lora = LoRARequest(req.lora_name, next(self._ids), req.lora_path, base_model_name)
            await state.client.add_lora(lora)  # the engine reads and checks it now
            state.loras[lora.lora_name] = lora
            if old is not None:  # replaced in place: the old weights go once their requests have finished
                await state.client.remove_lora(old.lora_int_id)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", lora.lora_name, lora.lora_path)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload(self, req: mp.UnloadLoRAAdapterRequest) -> str:
        state = self.state
        if not req.lora_name and not req.lora_int_id:
            raise ParamError("either 'lora_name' and 'lora_int_id' needs to be provided.", "lora_name")
        async with self._lock:
            lora = state.loras.get(req.lora_name) if req.lora_name else next(
                (lo for lo in state.loras.values() if lo.lora_int_id == req.lora_int_id), None)
            if lora is None:
                raise LoRANotFound(f"The lora adapter '{req.lora_name or req.lora_int_id}' cannot be found.")
            del state.loras[lora.lora_name]  # new requests for it are 404 from now on
            await state.client.remove_lora(lora.lora_int_id)  # the engine lets running ones finish first
        logger.info("Removed LoRA adapter: name '%s'", lora.lora_name)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."


def add_model_routes(app: FastAPI, models: OpenAIServingModels, runtime_updates: bool) -> None:
    @app.get("/v1/models")
    async def list_models():
        return json_response(models.models())

    if not runtime_updates:  # as vLLM: without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (404)
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: mp.LoadLoRAAdapterRequest):
        return Response(await models.load(body), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: mp.UnloadLoRAAdapterRequest):
        return Response(await models.unload(body), media_type="text/plain")
