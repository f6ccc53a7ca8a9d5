"""Tool-call parsers: the model's tool-call text to OpenAI ``tool_calls`` (registry in base.py)."""

from fulcrum.entrypoints.openai.tool_parsers.base import (
    PARSERS,
    ForcedParser,
    ParsedToolCall,
    ToolParser,
    get_parser,
    parser_for_template,
)

__all__ = [
    "PARSERS",
    "ForcedParser",
    "ParsedToolCall",
    "ToolParser",
    "get_parser",
    "parser_for_template",
]
