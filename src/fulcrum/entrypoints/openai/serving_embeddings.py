"""POST /v1/embeddings (input: a string, strings, token ids, lists of token ids), for a model
served with ``--runner pooling``: each input is one engine request, all of them batched by the
scheduler as any prompts are; the response lists one vector per input, in order."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fulcrum.engine.outputs import RequestOutput
from fulcrum.entrypoints.embedding import check_dimensions, embedding_params, finish_embedding
from fulcrum.entrypoints.openai.errors import bad_request
from fulcrum.entrypoints.openai.protocol import EmbeddingRequest
from fulcrum.entrypoints.openai.serving_base import (
    OpenAIServing,
    conversation_id,
    run_until_disconnect,
)


class ServingEmbeddings(OpenAIServing):
    endpoint = "embeddings"

    def pooler(self) -> Any:
        """The served model's ``PoolerConfig``; a 400 naming ``model`` for a text model."""
        mc = self.engine.model_config
        pc = getattr(mc, "pooler_config", None)
        if pc is None:
            raise bad_request(
                "This model generates text and does not serve embeddings; start the server "
                "with --runner pooling to serve a model's embeddings.",
                "model",
            )
        return pc

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        pc = self.pooler()
        hidden = getattr(self.engine.model_config.hf_config, "hidden_size", None)
        if hidden is not None:
            try:
                check_dimensions(req.dimensions, int(hidden))
            except ValueError as e:
                raise bad_request(str(e), "dimensions") from None
        if req.truncate_prompt_tokens == 0:
            raise bad_request(
                "truncate_prompt_tokens must be -1 or at least 1.", "truncate_prompt_tokens"
            )
        params = embedding_params(req.truncate_prompt_tokens)
        prompts = []
        for text, ids in self.split_prompts(req.input, "input"):
            cut = self.truncate_prompt(req, ids, 1)  # type: ignore[arg-type]
            if not cut:
                raise bad_request("An input is empty.", "input")
            limit = self.engine.max_model_len
            if len(cut) >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens, and an embedding "
                    f"input may hold {limit - 1}; an input has {len(cut)}. Shorten it or set "
                    "truncate_prompt_tokens.",
                    "input",
                    "context_length_exceeded",
                )
            prompts.append((text if len(cut) == len(ids) else None, cut))
        self.check_admission(len(prompts), "input")
        base = self.new_request_id("embd")
        rids = [f"{base}-{i}" if len(prompts) > 1 else base for i in range(len(prompts))]

        async def one(rid: str, text: str | None, ids: list[int]) -> RequestOutput:
            final = None
            gen = self.engine.generate(
                rid, ids, params, prompt=text, arrival_time=arrival, cache_salt=req.cache_salt,
                stream=False, priority=req.priority,
                lora=req.model if req.model in self.opts.lora_adapters else None,
            )  # fmt: skip
            async for out in gen:
                final = out
            if final is None or final.pooled is None:
                raise RuntimeError(f"request {rid}: the engine returned no embedding.")
            return final

        async def gather() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(one(r, t, i)) for r, (t, i) in zip(rids, prompts, strict=True)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        finals = await run_until_disconnect(raw, gather())
        data = []
        for i, final in enumerate(finals):
            assert final.pooled is not None
            vec = finish_embedding(final.pooled, pc, req.dimensions)
            emb: Any = (
                base64.b64encode(vec.astype("<f4").tobytes()).decode()
                if req.encoding_format == "base64"
                else vec.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": emb})
            self.log_request(
                request_id=final.request_id, model=model, prompt_token_ids=prompts[i][1],
                prompt=prompts[i][0], messages=None, arrival_time=arrival, final=final,
                first_token_time=None, num_output_tokens=0, finish_reason="stop",
                cache_salt=req.cache_salt, conversation_id=conversation_id(raw, req.user),
            )  # fmt: skip
        n = sum(len(ids) for _, ids in prompts)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )
