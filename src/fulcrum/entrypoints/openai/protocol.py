"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Request models validate shapes and ranges; anything that needs the model (context length,
vocabulary) is checked by the serving layer. Unknown fields are ignored, as OpenAI does.
Response models document the API (OpenAPI schema); the hot streaming path builds plain dicts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
TokenId = int


def _check_utf8(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid UTF-8 (no lone surrogates)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="after")
    def _valid_utf8(self) -> OpenAIBaseModel:
        for value in self.__dict__.values():
            if not isinstance(value, (int, float, bool, BaseModel)) and value is not None:
                _check_utf8(value)
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]


Stop = str | list[str] | None


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completions requests (OpenAI's plus vLLM's extras)."""

    model: str | None = Field(None, description="Served model name (see GET /v1/models).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be empty.")
    n: int = Field(1, ge=1, description="Number of choices (capped by the server's --max-n).")
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
    cache_salt: str | None = Field(
        None, description="Tenant salt: prefix-cache entries are shared only with the same salt."
    )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported; must be empty.")
    # Extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, description="Only with --trust-request-chat-template.")
    chat_template_kwargs: dict[str, Any] | None = None


CompletionPrompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingRequest):
    prompt: CompletionPrompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, description="Must equal n when given.")
    suffix: str | None = Field(None, description="Not supported; must be empty.")
    return_token_ids: bool = Field(
        False,
        description="Add token_ids (and prompt_token_ids) to each choice, as vLLM does; always "
        "on for a model served without a tokenizer.",
    )


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
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
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


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
