"""Loading and unloading LoRA adapters while serving (``--allow-runtime-lora-updates``), in
vLLM's shape: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer 200 with a
line of text. The engine core loads the adapter between two steps and tells every API process
which adapters it serves, so each one's ``/v1/models`` and model-name checks follow."""

from __future__ import annotations

from fastapi.responses import PlainTextResponse

from fulcrum.entrypoints.openai import errors as E
from fulcrum.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from fulcrum.entrypoints.openai.serving_base import ServerState


class ServingLoRA:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name in self.state.options.served_model_names:
            raise E.bad_request(f"lora_name: {name!r} is the base model's served name.", "lora_name")
        await self._call("add_lora", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await self._call("remove_lora", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _call(self, method: str, *args: str) -> None:
        engine = self.state.engine
        assert engine is not None
        try:
            await engine.call_core(method, *args)
        except LookupError as e:
            raise E.OpenAIError(str(e), 404, "invalid_request_error", "lora_name",
                                "model_not_found") from None  # fmt: skip
        except ValueError as e:
            raise E.value_error(e) from None
