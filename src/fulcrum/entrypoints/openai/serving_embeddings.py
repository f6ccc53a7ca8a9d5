"""The runner-pooling endpoints: POST /v1/embeddings (OpenAI), /classify, /v1/score and
/v1/rerank (vLLM's, the last in Jina's and Cohere's shape). Each input (or scored pair) is one
engine request, all of them batched by the scheduler as any prompts are; a response lists one
result per input, in order (rerank: best first)."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fulcrum.engine.outputs import RequestOutput
from fulcrum.entrypoints.embedding import (
    check_dimensions,
    classification,
    embedding_params,
    finish_embedding,
    score_plan,
)
from fulcrum.entrypoints.openai.errors import bad_request
from fulcrum.entrypoints.openai.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from fulcrum.entrypoints.openai.serving_base import (
    OpenAIServing,
    conversation_id,
    run_until_disconnect,
)


class ServingPooling(OpenAIServing):
    endpoint = "embeddings"

    def pooler(self, classifier: bool | None) -> Any:
        """The served model's ``PoolerConfig``, or a 400 naming ``model`` when it does not serve
        this endpoint (``classifier``: True needs labels, False embeddings, None either)."""
        pc = getattr(self.engine.model_config, "pooler_config", None)
        if pc is None:
            raise bad_request(
                "This model generates text and serves no embeddings, labels or scores; start "
                "the server with --runner pooling to serve a model's embeddings.",
                "model",
            )
        if classifier is True and not pc.num_labels:
            raise bad_request("This model computes embeddings, not labels: use /v1/embeddings.", "model")
        if classifier is False and pc.num_labels:
            raise bad_request("This model is a classifier: use /classify, /v1/score or /v1/rerank.", "model")
        return pc

    async def _run(
        self, req: PoolingRequest, raw: Request, prompts: list[tuple[str | None, list[int]]],
        param: str, prefix: str, arrival: float,
    ) -> list[RequestOutput]:  # fmt: skip
        """Check and cut each prompt, run them all, return their outputs in order (a client
        that hangs up aborts them)."""
        if req.truncate_prompt_tokens == 0:
            raise bad_request(
                "truncate_prompt_tokens must be -1 or at least 1.", "truncate_prompt_tokens"
            )
        limit = self.engine.max_model_len
        cut_prompts = []
        for text, ids in prompts:
            cut = self.truncate_prompt(req, ids, 1)  # type: ignore[arg-type]
            if not cut:
                raise bad_request(f"An {param} is empty.", param)
            if len(cut) >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens, and an {param} may "
                    f"hold {limit - 1}; one has {len(cut)}. Shorten it or set "
                    "truncate_prompt_tokens.",
                    param,
                    "context_length_exceeded",
                )
            cut_prompts.append((text if len(cut) == len(ids) else None, cut))
        self.check_admission(len(cut_prompts), param)
        params = embedding_params(req.truncate_prompt_tokens)
        base = self.new_request_id(prefix)
        rids = [f"{base}-{i}" if len(cut_prompts) > 1 else base for i in range(len(cut_prompts))]
        salt = getattr(req, "cache_salt", None)
        lora = req.model if req.model in self.opts.lora_adapters else None

        async def one(rid: str, text: str | None, ids: list[int]) -> RequestOutput:
            final = None
            async for out in self.engine.generate(
                rid, ids, params, prompt=text, arrival_time=arrival, cache_salt=salt,
                stream=False, priority=req.priority, lora=lora,
            ):  # fmt: skip
                final = out
            if final is None or final.pooled is None:
                raise RuntimeError(f"request {rid}: the engine returned no vector.")
            return final

        async def gather() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(one(r, t, i)) for r, (t, i) in zip(rids, cut_prompts, strict=True)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        finals = await run_until_disconnect(raw, gather())
        model = req.model or self.state.model_name
        for (text, ids), final in zip(cut_prompts, finals, strict=True):
            self.log_request(
                request_id=final.request_id, model=model, prompt_token_ids=ids, prompt=text,
                messages=None, arrival_time=arrival, final=final, first_token_time=None,
                num_output_tokens=0, finish_reason="stop", cache_salt=salt,
                conversation_id=conversation_id(raw, req.user),
            )  # fmt: skip
        return finals

    # -- endpoints ----------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        pc = self.pooler(classifier=False)
        hidden = getattr(self.engine.model_config.hf_config, "hidden_size", None)
        if hidden is not None:
            try:
                check_dimensions(req.dimensions, int(hidden))
            except ValueError as e:
                raise bad_request(str(e), "dimensions") from None
        prompts = self.split_prompts(req.input, "input")
        finals = await self._run(req, raw, prompts, "input", "embd", arrival)
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
        n = sum(len(f.prompt_token_ids) for f in finals)
        usage = {"prompt_tokens": n, "total_tokens": n}
        return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})

    async def classify(self, req: ClassificationRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        self.pooler(classifier=True)
        prompts = self.split_prompts(req.input, "input")
        finals = await self._run(req, raw, prompts, "input", "classify", arrival)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, final in enumerate(finals):
            assert final.pooled is not None
            c = classification(final.pooled)
            best = max(range(c.num_classes), key=c.probs.__getitem__)
            label = id2label.get(best, id2label.get(str(best), f"LABEL_{best}"))
            data.append({"index": i, "label": label, "probs": c.probs, "num_classes": c.num_classes})
        return JSONResponse(self._envelope(finals, model, data, "classify"))

    async def _scores(
        self, req: PoolingRequest, raw: Request, text_1: list[str], text_2: list[str], param: str,
        prefix: str, arrival: float,
    ) -> tuple[list[float], list[RequestOutput]]:  # fmt: skip
        pc = self.pooler(classifier=None)
        tok = self.need_tokenizer("Scoring texts", param)
        try:
            prompts, combine = score_plan(tok, pc, text_1, text_2)
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise bad_request(str(e), param if field == "text_1" else field) from None
        finals = await self._run(req, raw, [(None, p) for p in prompts], param, prefix, arrival)
        return combine([f.pooled for f in finals]), finals  # type: ignore[misc]

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        a = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        b = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if len(a) == 1:
            a = a * len(b)
        scores, finals = await self._scores(req, raw, a, b, "text_1", "score", arrival)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse(self._envelope(finals, model, data, "score"))

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        docs = req.documents
        scores, finals = await self._scores(
            req, raw, [req.query] * len(docs), docs, "documents", "rerank", arrival
        )
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": docs[i]}
            results.append(item)
        n = sum(len(f.prompt_token_ids) for f in finals)
        return JSONResponse(
            {"id": self.new_request_id("rerank"), "model": model, "usage": {"total_tokens": n},
             "results": results}  # fmt: skip
        )

    def _envelope(
        self, finals: list[RequestOutput], model: str, data: list[dict[str, Any]], prefix: str
    ) -> dict[str, Any]:
        n = sum(len(f.prompt_token_ids) for f in finals)
        return {
            "id": self.new_request_id(prefix),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
        }
