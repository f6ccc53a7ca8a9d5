"""The offline Python API, in vLLM's shape: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.engine.core import EngineCore
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import RequestOutput
from fulcrum.entrypoints.embedding import (
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    check_dimensions,
    classification,
    embedding_params,
    finish_embedding,
    score_plan,
)
from fulcrum.model.loader.tokenizer import load_tokenizer
from fulcrum.protocol import EngineCoreRequest, to_wire
from fulcrum.sampling_params import SamplingParams, tokenize_bad_words, truncate_prompt

Prompt = str | list[int] | dict[str, Any]


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """``max_tokens=None`` means "up to the context limit"."""
    if params.max_tokens is not None:
        return params.max_tokens
    return max_model_len - num_prompt_tokens


class LLM:
    """Run a model in this process. ``LLM()`` serves the embedded SmolLM2-135M-Instruct.

    Keyword arguments are ``EngineArgs`` fields (``dtype``, ``device``, ``load_format``,
    ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``seed``,
    ``kv_cache_memory``, ``enable_prefix_caching``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown LLM argument.")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model_config)
        self.core = EngineCore(self.config)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    # -- prompts ------------------------------------------------------------------------------

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids.")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt: expected a string, a list of token ids, or a dict.")

    def _normalize(self, prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids`` and optionally ``cache_salt`` (prefix-cache namespace per tenant).
        ``priority``: one integer per prompt, lower first (default 0 each): the waiting queue
        admits lower values first, and when the KV cache runs out the highest value is
        preempted first. ``lora``: the adapter (a ``lora_modules`` name) for every prompt, or
        one name (None: the base model) per prompt.
        """
        if self.config.model_config.pooler_config is not None:
            raise ValueError(
                "runner: this model is served by runner pooling (embeddings or labels); use "
                "LLM.embed, LLM.classify or LLM.score."
            )
        return self._generate(prompts, sampling_params, use_tqdm, priority, lora)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (an embedding model: ``LLM(model,
        runner="pooling")``, or a bare decoder checkpoint). ``dimensions``: keep the first
        ``d`` components (Matryoshka models), normalized after the cut where the model
        normalizes. ``truncate_prompt_tokens``: keep only the last ``k`` prompt tokens (-1: as
        many as fit)."""
        pc = self._pooler("embed")
        check_dimensions(dimensions, int(self.config.model_config.hf_config.hidden_size))
        outs = self._pooled(prompts, truncate_prompt_tokens, use_tqdm, lora, "Embedding")
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt, o.prompt_token_ids,
                                   EmbeddingOutput(finish_embedding(vec, pc, dimensions).tolist()))
            for o, vec in outs
        ]  # fmt: skip

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's labels for every prompt (``...ForSequenceClassification``):
        each output's ``probs`` (softmax; one label: its sigmoid) and ``logits``."""
        self._pooler("classify")
        outs = self._pooled(prompts, truncate_prompt_tokens, use_tqdm, None, "Classifying")
        return [
            ClassificationRequestOutput(o.request_id, o.prompt, o.prompt_token_ids, classification(vec))
            for o, vec in outs
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """How well each ``text_2`` matches ``text_1`` (one against many, or pairwise): a
        one-label classifier (a cross-encoder reranker) reads each pair as one prompt (the
        tokenizer's pair encoding) and gives its sigmoid; an embedding model gives the cosine
        of the two embeddings."""
        pc = self._pooler("score")
        a = [text_1] if isinstance(text_1, str) else list(text_1)
        b = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(a) == 1:
            a = a * len(b)
        prompts, combine = score_plan(self.tokenizer, pc, a, b)
        outs = self._pooled(prompts, truncate_prompt_tokens, use_tqdm, None, "Scoring")
        scores = combine([vec for _, vec in outs])
        if pc.num_labels:
            ids = [o.prompt_token_ids for o, _ in outs]
        else:  # each pair's two prompts
            ids = [outs[i][0].prompt_token_ids + outs[len(a) + i][0].prompt_token_ids for i in range(len(a))]
        return [
            ScoringRequestOutput(outs[i][0].request_id, ids[i], ScoringOutput(scores[i]))
            for i in range(len(a))
        ]

    def _pooler(self, what: str):  # noqa: ANN202 - PoolerConfig
        """The model's pooling, or ValueError naming the method that fits it."""
        pc = self.config.model_config.pooler_config
        if pc is None:
            raise ValueError(
                f"runner: this model generates text; LLM(model, runner='pooling') serves it "
                f"for {what}."
            )
        if what == "embed" and pc.num_labels:
            raise ValueError("runner: this model is a classifier; use LLM.classify or LLM.score.")
        if what == "classify" and not pc.num_labels:
            raise ValueError("runner: this model computes embeddings; use LLM.embed or LLM.score.")
        return pc

    def _pooled(
        self, prompts, truncate: int | None, use_tqdm: bool, lora, desc: str
    ) -> list[tuple[RequestOutput, bytes]]:
        """Each prompt's output and pooled vector (runner pooling), in order."""
        outs = self._generate(prompts, embedding_params(truncate), use_tqdm, None, lora, desc=desc)
        for o in outs:
            if o.pooled is None:
                raise RuntimeError(f"request {o.request_id}: the engine returned no vector.")
        return [(o, o.pooled) for o in outs]  # type: ignore[misc]

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        lora: str | Sequence[str | None] | None,
        desc: str = "Generating",
    ) -> list[RequestOutput]:
        items = self._normalize(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(
                f"sampling_params: got {len(params)} for {len(items)} prompts; pass one or one each."
            )
        prios = [0] * len(items) if priority is None else list(priority)
        if len(prios) != len(items) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in prios
        ):
            raise ValueError(f"priority: pass one integer per prompt ({len(items)}).")
        loras = list(lora) if lora is not None and not isinstance(lora, str) else [lora] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"lora: pass one adapter name, or one (or None) per prompt ({len(items)}).")
        order: list[str] = []
        try:
            for prompt, sp, prio, name in zip(items, params, prios, loras, strict=True):
                order.append(self._add(prompt, sp, prio, name))
            return self._run(order, use_tqdm, desc)
        except BaseException:
            self.core.abort_requests(order)
            for rid in order:
                self.processor.abort_request(rid)
            while self.core.has_unfinished_requests():
                self.core.step()
            raise

    def _add(
        self, prompt: Prompt, sp: SamplingParams, priority: int = 0, lora: str | None = None
    ) -> str:
        text, ids = self._tokenize(prompt)
        full = ids
        ids = truncate_prompt(full, sp.truncate_prompt_tokens, self.max_model_len, sp.max_tokens)
        if len(ids) < len(full):
            text = None  # the text no longer matches the ids
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        rid = str(next(self._ids))
        tokenize_bad_words(sp, self.tokenizer)
        wire = to_wire(sp, resolve_max_tokens(sp, len(ids), self.max_model_len))
        self.core.add_request(
            EngineCoreRequest(
                rid, ids, wire, time.time(), cache_salt=salt, priority=priority, lora=lora
            )
        )
        self.processor.add_request(rid, text, ids, sp, time.time(), stream=False)
        return rid

    def _run(self, order: list[str], use_tqdm: bool, desc: str) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc=desc, unit="req", dynamic_ncols=True)
        while self.core.has_unfinished_requests():
            outs = self.core.step()
            results, to_abort = self.processor.process_outputs(outs.outputs)
            if to_abort:
                self.core.abort_requests(to_abort)
            for r in results:
                done[r.request_id] = r
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer or chat template.")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conv in convs:
            try:
                text = self.tokenizer.apply_chat_template(
                    conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                )
            except Exception as e:
                raise ValueError(f"messages: cannot apply the chat template: {e}") from None
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> dict[str, Any]:
        import msgspec

        return msgspec.structs.asdict(self.core.get_stats())

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory ``path`` as ``name`` from now on, in a free adapter
        slot (``allow_runtime_lora_updates=True``, ``max_loras``); ValueError naming the field
        otherwise."""
        self.core.add_lora(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name``; LookupError if none is loaded by that name."""
        self.core.remove_lora(name)
