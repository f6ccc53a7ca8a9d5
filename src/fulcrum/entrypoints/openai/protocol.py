"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Request models validate shapes, ranges and types, strictly as OpenAI does (no boolean for a number);
limits are Field constraints, so the OpenAPI schema states what validation enforces. Anything that
needs the model or the server's flags (context length, vocabulary, --max-n) is checked by the
serving layer, and openapi.py writes those bounds into the schema. Unknown fields are ignored, as
OpenAI does.
Response models document the API (OpenAPI schema); the hot streaming path builds plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticUndefined

from fulcrum.entrypoints.openai.limits import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
)
from fulcrum.entrypoints.openai.messages import ChatMessage, OpenAIBaseModel

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_DESCRIPTION = "A token id, below the vocabulary size."
TokenId = Annotated[int, Field(ge=0, description=TOKEN_ID_DESCRIPTION)]


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


StopString = Annotated[str, Field(max_length=MAX_STOP_LEN)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class NullIsDefault(OpenAIBaseModel):
    """OpenAI types most optional fields as "value or null", and client wrappers send ``null`` for
    what the caller left unset: an explicit ``null`` on a field with a default means that
    default. Required fields keep their ``null``, which then fails validation by name."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        drop = set()
        for name, f in cls.model_fields.items():
            key = f.alias or name
            if key in data and data[key] is None and f.default not in (None, PydanticUndefined):
                drop.add(key)
        return {k: v for k, v in data.items() if k not in drop} if drop else data


class SamplingRequest(NullIsDefault):
    """Fields shared by chat and completions requests (OpenAI's plus vLLM's extras)."""

    model: str | None = Field(None, description="Served model name (see GET /v1/models).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (a decimal string) -> bias in [-100, 100] added to that token's "
        "logit before sampling: -100 all but bans it, 100 all but forces it.",
    )
    n: int = Field(
        1, ge=1, le=MAX_N, description="Number of choices (the server's --max-n may lower the cap)."
    )
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Stop = Field(None, description="Up to 16 stop strings, never part of the output.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    user: str | None = Field(None, description="End-user id; logged as the conversation id.")
    # Extensions (vLLM's names).
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = Field(
        False,
        description='Logprobs name each token "token_id:<id>" instead of its text: exact for '
        "tokens that are not valid UTF-8 alone (vLLM's extension).",
    )
    cache_salt: str | None = Field(
        None, description="Tenant salt: prefix-cache entries are shared only with the same salt."
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Keep only the last k prompt tokens (-1: as many as fit in the context beside "
        "max_tokens); 0 is invalid (vLLM's extension).",
    )
    allowed_token_ids: list[TokenId] | None = Field(
        None, description="The only token ids that may be generated (vLLM's extension)."
    )
    bad_words: list[str] | None = Field(
        None,
        description="Words that must not be generated: a word's last token is banned where "
        "its other tokens were just generated (vLLM's extension).",
    )
    priority: int = Field(
        0,
        ge=INT64_MIN,
        le=INT64_MAX,
        description="Scheduling priority, lower first: the queue admits lower values first and, "
        "when the KV cache is full, preempts the highest value first.",
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="Exactly one of json (schema), regex, choice, grammar (EBNF), structural_tag.",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="structured_outputs.json")
    guided_regex: str | None = Field(None, description="structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="structured_outputs.grammar")
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="vLLM's extension: each prompt token's logprob and rank, with this many "
        "most likely alternatives, in the response's prompt_logprobs (the first token's entry "
        "null). Not with stream.",
    )
    return_token_ids: bool = Field(
        False,
        description="Add token_ids (and prompt_token_ids) to each choice, as vLLM does; a streamed "
        "step then reaches the client even when its tokens have no text yet. Always on for "
        "completions of a model served without a tokenizer.",
    )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class FunctionDef(OpenAIBaseModel):
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True
    # Extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_reasoning: bool = Field(
        True,
        description="With the server's --reasoning-parser: false drops the thinking from the "
        "response (vLLM's extension).",
    )
    chat_template: str | None = Field(None, description="Only with --trust-request-chat-template.")
    chat_template_kwargs: dict[str, Any] | None = None


CompletionPrompt = (
    str
    | Annotated[list[str], Field(max_length=MAX_PROMPTS_PER_REQUEST)]
    | list[TokenId]
    | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS_PER_REQUEST)]
)
# JSON Schema's maxLength only constrains strings, so null stays valid; the serving layer
# answers a non-empty suffix with 400 naming it.
_UNSUPPORTED_STR: dict[str, Any] = {"maxLength": 0}


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(
        16, ge=0, description="0 only with echo: the prompt scored, nothing generated."
    )
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Must equal n when given.")
    suffix: str | None = Field(
        None, description="Not supported; must be empty.", json_schema_extra=_UNSUPPORTED_STR
    )


class PoolingRequest(NullIsDefault):
    """Fields every runner-pooling request shares (vLLM's extensions)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep only the last k tokens of each input (-1: as many as fit)."
    )
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class ClassificationRequest(PoolingRequest):
    """vLLM's POST /classify: a sequence classifier's labels for each input."""

    input: CompletionPrompt


class ScoreRequest(PoolingRequest):
    """vLLM's POST /v1/score: ``text_2`` scored against ``text_1`` (one against many, or
    pairwise) by a one-label classifier (a cross-encoder) or an embedding model's cosine."""

    text_1: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
    text_2: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]


class RerankRequest(PoolingRequest):
    """The Jina / Cohere rerank request (POST /v1/rerank, /rerank, /v2/rerank): ``documents``
    ordered by their score against ``query``, the best ``top_n``."""

    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
    top_n: int | None = Field(None, ge=1, description="Return the best n (default: all).")
    return_documents: bool = True


class EmbeddingRequest(PoolingRequest):
    """OpenAI's embeddings request, plus vLLM's ``truncate_prompt_tokens``; served by a model
    started with ``--runner pooling`` (or a bare decoder checkpoint)."""

    input: CompletionPrompt
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as little-endian float32 bytes, base64-encoded."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Keep the first d components (normalized after the cut)."
    )
    cache_salt: str | None = None


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's shape): serve the PEFT adapter directory
    ``lora_path`` on the server's disk as the model ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str | None = None  # accepted as vLLM's clients send it; the name decides


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # with prompt_logprobs: per prompt token (null for the first) {token id: logprob entry}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (first chunk when streamed)
    token_ids: list[int] | None = None  # with return_token_ids (each chunk's new tokens)
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # as the chat response's


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fulcrum"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
