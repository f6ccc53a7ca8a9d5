"""The Responses API's request (``POST /v1/responses``, OpenAI's newer endpoint that agents and the
``client.responses`` SDK call) and its translation into a chat completion request: the input items
become chat messages, ``text.format`` the response format, flat function tools chat tools.

Nothing is stored on the server: ``previous_response_id`` and ``background`` are refused by name,
and a conversation is sent whole in ``input`` (function calls and their outputs included), as
stateless clients do."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from fulcrum.entrypoints.openai.limits import MAX_LOGPROBS
from fulcrum.entrypoints.openai.messages import OpenAIBaseModel
from fulcrum.entrypoints.openai.protocol import INT64_MAX, INT64_MIN

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_MEDIA = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


class InputText(OpenAIBaseModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> InputText:
        if self.type in _MEDIA:
            raise ValueError(f"this model reads text only, not {_MEDIA[self.type]} ({self.type})")
        if self.type not in ("input_text", "output_text", "text", "refusal") or self.text is None:
            raise ValueError(f"a content part is input_text or output_text with a text, not {self.type!r}")
        return self


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(..., min_length=1)
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(OpenAIBaseModel):
    """A reasoning item sent back with the conversation: dropped (templates strip thinking)."""

    type: Literal["reasoning"]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(OpenAIBaseModel):
    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """``null`` means the default (as in the chat API); an input message may leave out its
        ``type`` (the SDK's "easy" message form)."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k == "input"}
        items = data.get("input")
        if isinstance(items, list):
            data["input"] = [
                {**i, "type": "message"} if isinstance(i, dict) and "type" not in i else i
                for i in items
            ]
        return data

    model: str | None = Field(None, description="Served model name (see GET /v1/models).")
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = Field(
        None, description=f"{LOGPROBS_INCLUDE!r} returns the output text's logprobs."
    )
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Accepted; effort is not tunable.")
    metadata: dict[str, str] | None = None
    store: bool = Field(False, description="Accepted; responses are never stored here.")
    background: bool = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    # Extensions (vLLM's names, as in the chat API).
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    structured_outputs: dict[str, Any] | None = Field(
        None, description="As in the chat API: one of json, regex, choice, grammar, structural_tag."
    )

    @model_validator(mode="before")
    @classmethod
    def _only_function_tools(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tools"), list):
            for i, tool in enumerate(data["tools"]):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(
                        f"tools[{i}].type: only function tools run here, not {kind!r} "
                        "(built-in tools such as web_search are OpenAI's own)."
                    )
        return data

    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


def _content(content: str | list[InputText]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` then the input items as chat messages: a run of function calls joins
    the assistant message before it (or makes one), each output is a tool message."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body that asks the engine the same thing."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "structured_outputs": req.structured_outputs,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.wants_logprobs():
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.truncation == "auto":
        body["truncate_prompt_tokens"] = -1
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}  # fmt: skip
    elif req.tool_choice not in ("auto", "none"):
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else "required"
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                "description": fmt.description}  # fmt: skip
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    return body


# Chat request fields as the Responses request names them (an error names the caller's field).
PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}
