"""The wire's sampling parameters are ``SamplingParams``' core fields, and survive msgpack."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from fulcrum.protocol import CORE_FIELDS, EngineCoreRequest, WireSamplingParams, to_wire
from fulcrum.sampling_params import SamplingParams


def test_wire_fields_follow_sampling_params():
    assert WireSamplingParams.__struct_fields__ == tuple(CORE_FIELDS)
    user = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    wire = WireSamplingParams()
    # None / empty set (or a default factory) as lists
    resolved = {"stop_token_ids": [], "all_stop_token_ids": [], "bad_words_token_ids": []}
    for name in CORE_FIELDS:
        assert getattr(wire, name) == resolved.get(name, user[name]), name


def test_to_wire_round_trips_through_msgpack():
    sp = SamplingParams(
        n=2, temperature=0.7, top_p=0.8, top_k=5, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=3, min_tokens=2,
        stop_token_ids=[9, 4], ignore_eos=True, logprobs=3, logit_bias={7: -100, 12: 2.5},
        allowed_token_ids=[3, 7, 12],
    )
    wire = to_wire(sp, max_tokens=0)
    assert wire.max_tokens == 1  # resolved by the caller, never below one
    for name in CORE_FIELDS:
        if name not in ("max_tokens", "all_stop_token_ids"):
            assert getattr(wire, name) == getattr(sp, name), name
    req = EngineCoreRequest("r", [1, 2], wire)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req and not back.sampling_params.greedy
    assert to_wire(SamplingParams(temperature=0.0), 4).greedy


@pytest.mark.parametrize(
    ("bias", "why"),
    [({-1: 1.0}, "keys"), ({"7": 1.0}, "keys"), ({True: 1.0}, "keys"), ({7: 100.5}, "values"),
     ({7: float("nan")}, "values"), ({7: "up"}, "values")],
)
def test_logit_bias_is_checked_and_normalised(bias, why):
    with pytest.raises(ValueError, match=f"logit_bias {why}"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}
    assert SamplingParams(logit_bias={}).logit_bias is None  # nothing to add: the plain path


def test_json_schema_travels_as_text():
    """A schema may hold integers past msgpack's 64 bits (the server's fuzzing sent one): it
    crosses to the core as its canonical JSON text, the grammar cache's key unchanged."""
    from fulcrum.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": -(10**30)}}}
    so = StructuredOutputsParams(json=schema)
    req = EngineCoreRequest("r", [1], to_wire(SamplingParams(structured_outputs=so), 4))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    got = back.sampling_params.structured_outputs
    assert got.kind == "json" and got.spec == so.spec
