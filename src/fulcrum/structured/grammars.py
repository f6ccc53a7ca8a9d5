"""A ``StructuredOutputsParams`` as an xgrammar ``Grammar`` (tokenizer-free): used both to validate
a request up front and, by the backend, to compile it for a tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any

from fulcrum.sampling_params import StructuredOutputsParams

# JSON-schema keywords xgrammar does not enforce: a request using one would get output that
# may not validate, so it is refused instead.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "uniqueItems",
     "contains", "minContains", "maxContains", "multipleOf", "patternProperties",
     "propertyNames", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef"}
)


def _ebnf_literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def schema_of(params: StructuredOutputsParams) -> dict[str, Any] | bool:
    value = params.json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError("the JSON schema must be an object.")
    return value


def unsupported_keywords(schema: Any) -> set[str]:
    """Unsupported keywords anywhere in ``schema`` (property names are not keywords)."""
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, sub in schema.items():
            if key in UNSUPPORTED_SCHEMA_KEYWORDS:
                found.add(key)
            if key in ("properties", "$defs", "definitions") and isinstance(sub, dict):
                for v in sub.values():
                    found |= unsupported_keywords(v)
            elif key not in ("enum", "const", "default", "examples", "required"):
                found |= unsupported_keywords(sub)
    elif isinstance(schema, list):
        for v in schema:
            found |= unsupported_keywords(v)
    return found


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar ``Grammar``; ValueError naming what is wrong otherwise."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(schema_of(params)), any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar or "")
        tag = params.structural_tag or ""
        return xgr.Grammar.from_structural_tag(tag)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own types on bad input
        raise ValueError(_library_message(str(e)) or type(e).__name__) from None


# xgrammar's C++ errors begin "[hh:mm:ss] /path/file.cc:line: ": where in the library, not
# what is wrong with the request.
_LIBRARY_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")


def _library_message(text: str) -> str:
    return _LIBRARY_PREFIX.sub("", text.strip())
