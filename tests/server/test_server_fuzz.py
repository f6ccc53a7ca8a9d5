"""Schemathesis against the server's own OpenAPI schema: no 5xx, still healthy afterwards."""

from __future__ import annotations

import time
from typing import Any

import pytest
from srv_helpers import API_KEY, MODEL, Server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

MIN_REQUESTS = 500
# Examples per (method, mode): invalid bodies are cheap (400), valid generation bodies are not.
EXAMPLES = {
    ("POST", "positive"): 35,
    ("POST", "negative"): 100,
    ("GET", "positive"): 12,
    ("GET", "negative"): 12,
}
_CLAMP = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")


def _bound_cost(body: Any) -> Any:
    """Keep generation cheap on a CPU: small outputs, few choices (other fields stay fuzzed)."""
    if not isinstance(body, dict):
        return body
    for k in _CLAMP:
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            body[k] = 1
    if "messages" in body or "prompt" in body or "input" in body:
        limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
        if all(body.get(k) is None for k in limits):
            body["max_output_tokens" if "input" in body else "max_tokens"] = 1
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 2:
            body["n"] = 2
        if isinstance(body.get("model"), str) and len(body["model"]) % 4:
            body["model"] = MODEL  # mostly the served model, sometimes a random (404) one
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 3 and not isinstance(prompt[0], int):
            body["prompt"] = prompt[:3]
    return body


def test_fuzz_openapi_no_server_errors(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json", headers=headers)
    statuses: list[int] = []
    failures: list[str] = []
    timings: dict[str, float] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = op.as_strategy(generation_mode=mode)

            @settings(
                max_examples=EXAMPLES[(op.method.upper(), str(mode.value))],
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def run(case: Any) -> None:
                case.body = _bound_cost(case.body) if case.body is not None else case.body
                resp = case.call(base_url=server.base_url, headers=headers, timeout=120)
                statuses.append(resp.status_code)
                if resp.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {case.body!r} -> {resp.text[:300]}")

            t0 = time.monotonic()
            try:
                run()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing to make invalid (no inputs)
            timings[label] = timings.get(label, 0.0) + time.monotonic() - t0
    print("fuzz seconds per operation:", {k: round(v, 1) for k, v in timings.items()})
    assert not failures, "\n".join(failures[:10])
    assert len(statuses) >= MIN_REQUESTS, len(statuses)
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("GET", "/ready", key=None)[0] == 200
    status, body = server.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


# Small on purpose: this one checks every response against the schema, so a contradiction shows
# up within a few examples per operation; the test above is the broad no-5xx sweep.
CONFORMANCE_EXAMPLES = {"positive": 10, "negative": 25}


def test_fuzz_responses_match_the_schema(server: Server) -> None:
    from schemathesis import checks
    from schemathesis.core.failures import FailureGroup

    headers = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json", headers=headers)
    conformance = [
        checks.not_a_server_error,
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_schema_conformance,
        checks.response_headers_conformance,
    ]
    failures: list[str] = []
    calls = 0
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=CONFORMANCE_EXAMPLES[str(mode.value)],
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                nonlocal calls
                case.body = _bound_cost(case.body) if case.body is not None else case.body
                resp = case.call(base_url=server.base_url, headers=headers, timeout=120)
                calls += 1
                try:
                    case.validate_response(resp, checks=conformance, headers=headers)
                except FailureGroup as e:
                    failures.append(f"{case.method} {case.path}: {e}\nbody: {case.body!r}"[:3000])

            try:
                run()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing to make invalid (no inputs)
    print(f"conformance fuzz: {calls} calls in {time.monotonic() - t0:.1f} s")
    assert not failures, "\n\n".join(failures[:5])
    assert calls >= 60, calls
