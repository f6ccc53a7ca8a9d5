"""The strict base of the API's models, and chat messages, one model per role as OpenAI's API
defines them.

The role picks the model (a discriminated union), so a message missing what its role needs fails
validation naming the field (``messages[0].tool_call_id``), and an unknown role fails on ``role``.
Media content parts (images, audio, files) are recognised before the text-only part schema so the
client learns why they are refused instead of reading a type mismatch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ROLES = ("system", "developer", "user", "assistant", "tool")

# Content part types OpenAI accepts that this text-only model cannot read.
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "file": "file",
    "video_url": "video",
}


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
    # Strict as OpenAI is: no bool for a number, no number for a bool or a string (a float
    # field still takes an integer).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="after")
    def _valid_utf8(self) -> OpenAIBaseModel:
        for value in self.__dict__.values():
            if not isinstance(value, (int, float, bool, BaseModel)) and value is not None:
                _check_utf8(value)
        return self


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


Content = str | list[TextContentPart]


class _Message(OpenAIBaseModel):
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_media(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = _MEDIA_PARTS.get(part.get("type")) if isinstance(part, dict) else None
                if kind is not None:
                    raise ValueError(
                        f"content[{i}]: {kind} inputs are not supported by this model."
                    )
        return data

    def text(self) -> str:
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(p.text for p in content)

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (content flattened to text)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        return d


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="Required unless tool_calls is given.")
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("content: an assistant message needs content or tool_calls.")
        return self

    def as_dict(self) -> dict[str, Any]:
        d = super().as_dict()
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return d


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]
