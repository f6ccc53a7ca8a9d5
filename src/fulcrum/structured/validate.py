"""Check a constraint before its request is queued: the schema is a valid JSON schema using only
keywords the backend enforces, the regex / grammar / structural tag parses. Tokenizer-free (the
frontend runs it); the engine compiles the same ``Grammar`` later, off its loop."""

from __future__ import annotations

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.grammars import build_grammar, schema_of, unsupported_keywords


def validate_structured(params: StructuredOutputsParams) -> None:
    """ValueError whose message starts with the offending field (``structured_outputs.<kind>``)."""
    field = f"structured_outputs.{params.kind}"
    try:
        if params.kind == "json":
            import jsonschema

            schema = schema_of(params)
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                raise ValueError(f"invalid JSON schema: {e.message}") from None
            bad = unsupported_keywords(schema)
            if bad:
                raise ValueError(f"unsupported JSON-schema keyword(s): {', '.join(sorted(bad))}.")
        build_grammar(params)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
