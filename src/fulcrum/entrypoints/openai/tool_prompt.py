"""Tools into the prompt. A template that renders ``tools`` itself gets them as its ``tools``
variable (transformers' ``apply_chat_template(tools=...)``); for one that does not, the tools are
described in a system message in the Hermes format, and earlier tool calls and results are
written as ``<tool_call>`` / ``<tool_response>`` text, so any chat model can take part."""

from __future__ import annotations

import json
from typing import Any

_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_renders_tools(template: str) -> bool:
    return "tools" in template


def tools_as_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def with_tool_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates expect each earlier call's arguments as a mapping (OpenAI sends JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _args(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools described in the system message and tool turns as text."""
    system = _SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    if messages and messages[0]["role"] in ("system", "developer"):
        out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + system})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": _args(c["function"]["arguments"])},
                    ensure_ascii=False,
                ) + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            text = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    return out


# OpenAI: "omitting parameters defines a function with an empty parameter list".
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any]:
    """JSON schema of the calls ``required`` / a named ``tool_choice`` forces: an array of
    ``{"name", "parameters"}`` objects (one item unless ``parallel``)."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    item = items[0] if len(items) == 1 else {"anyOf": items}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel or name is not None:
        schema["maxItems"] = 1
    return schema
