"""A request's output constraint: ``response_format`` (chat), ``structured_outputs`` and the older
``guided_*`` fields (chat and completions), as one validated ``StructuredOutputsParams``. Bad input
is a 400 naming the field, before the request is queued."""

from __future__ import annotations

from typing import Any

from fulcrum.entrypoints.openai.errors import OpenAIError, bad_request
from fulcrum.entrypoints.openai.protocol import SamplingRequest
from fulcrum.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from fulcrum.structured.validate import validate_structured

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    unknown = set(fields) - set(STRUCTURED_KINDS)
    if unknown:
        raise bad_request(f"{param}: unknown field(s) {', '.join(sorted(unknown))}.", param)
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from None


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    js = rf.json_schema
    if js is None or js.schema_ is None:
        raise bad_request(
            "response_format.json_schema.schema is required for type 'json_schema'.",
            "response_format.json_schema",
        )
    return {"json": js.schema_}


def structured_params(
    req: SamplingRequest, extra: dict[str, Any] | None = None
) -> StructuredOutputsParams | None:
    """The one constraint of ``req`` (``extra``: one the server adds, e.g. a named tool's schema)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if extra is not None:
        sources.append(("tool_choice", extra))
    rf = _response_format(getattr(req, "response_format", None))
    if rf is not None:
        sources.append(("response_format", rf))
    if req.structured_outputs is not None:
        given = {k: v for k, v in req.structured_outputs.items() if v is not None}
        sources.append(("structured_outputs", given))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise bad_request(f"only one output constraint may be given; got {names}.", sources[1][0])
    param, fields = sources[0]
    params = _params(fields, param)
    try:
        validate_structured(params)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "invalid_request_error", param) from None
    return params


def check_tool_schemas(tools: list[dict[str, Any]], enforced: bool) -> None:
    """Each tool's ``parameters`` is a valid JSON schema; where calls are forced (``enforced``),
    also one the grammar backend can enforce. The 400 names the tool's field, not the forced
    call array's schema built from it."""
    import jsonschema

    for i, tool in enumerate(tools):
        schema = tool["function"].get("parameters")
        if schema is None:
            continue
        param = f"tools[{i}].function.parameters"
        try:
            if enforced:
                validate_structured(StructuredOutputsParams(json=schema))
            else:
                jsonschema.validators.validator_for(schema).check_schema(schema)
        except ValueError as e:
            msg = str(e).removeprefix("structured_outputs.json: ")
            raise bad_request(f"{param}: {msg}", param) from None
        except jsonschema.SchemaError as e:
            raise bad_request(f"{param}: invalid JSON schema: {e.message}", param) from None

