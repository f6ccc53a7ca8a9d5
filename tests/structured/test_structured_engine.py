"""Constrained generation end to end on the embedded model (offline ``LLM``, asynchronous
scheduling on): generated JSON schemas, regex, choice, EBNF, n > 1, EOS and length."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum import LLM, SamplingParams
from fulcrum.sampling_params import StructuredOutputsParams as SO

NUM_SCHEMAS = 200  # each generated greedy and sampled: 400 constrained sequences in one batch
MAX_TOKENS = 48  # the schemas below are small enough that their instances fit


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", kv_cache_memory=0.25, async_scheduling="on")


def _prompt(llm: LLM, q: str) -> str:
    tok = llm.get_tokenizer()
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                   add_generation_prompt=True)


_names = st.sampled_from(["id", "name", "tags", "score", "kind", "items", "ok", "code"])
_leaf = st.one_of(
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
    st.just({"type": "string", "pattern": "^[a-z]{2,6}$"}),
    st.just({"type": "string", "pattern": "^[0-9]{3}-[A-Z]{2}$"}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "blue", "x y", "1"]), min_size=1, max_size=4,
             unique=True).map(lambda e: {"enum": e}),
)


def _schema(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    obj = st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req,
                         "additionalProperties": False}))
    arr = st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n},
                    children, st.integers(1, 2))
    return st.one_of(obj, arr)


SCHEMAS = st.recursive(_leaf, _schema, max_leaves=3).filter(
    lambda s: s.get("type") in ("object", "array")
)


def _check(llm: LLM, schemas: list[dict[str, Any]]) -> None:
    """Each schema greedy and sampled, all in one batch: every finished output validates."""
    prompt = _prompt(llm, "Reply with JSON.")
    runs = [(s, t) for t in (0.0, 1.0) for s in schemas]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=SO(json=s)) for i, (s, t) in enumerate(runs)]
    outs = llm.generate([prompt] * len(runs), params, use_tqdm=False)
    stopped = {0.0: 0, 1.0: 0}
    for (s, t), o in zip(runs, outs, strict=True):
        c = o.outputs[0]
        if c.finish_reason == "length":
            assert c.text.lstrip()[:1] in "{[", c.text  # a valid prefix, cut by max_tokens
            continue
        stopped[t] += 1
        jsonschema.validate(json.loads(c.text), s)
    assert min(stopped.values()) >= 0.8 * len(schemas), stopped


@settings(max_examples=1, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(SCHEMAS, min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS))
def test_generated_schemas_validate(llm: LLM, schemas: list[dict[str, Any]]) -> None:
    _check(llm, schemas)


def test_regex_choice_grammar_and_n(llm: LLM) -> None:
    p = _prompt(llm, "Give me a code.")
    outs = llm.generate([p, p, p], [
        SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=16,
                       structured_outputs=SO(regex=r"[A-Z]{2}-\d{2,3}")),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(choice=["yes", "no"])),
        SamplingParams(temperature=0.5, seed=4, max_tokens=24, structured_outputs=SO(
            grammar='root ::= "[" item ("," item)* "]"\nitem ::= "a" | "bb" | [0-9]')),
    ], use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        assert re.fullmatch(r"[A-Z]{2}-\d{2,3}", c.text), c.text
    assert outs[1].outputs[0].text in ("yes", "no")
    text = outs[2].outputs[0].text
    assert re.fullmatch(r"\[(a|bb|[0-9])(,(a|bb|[0-9]))*\]", text) or (
        outs[2].outputs[0].finish_reason == "length" and text.startswith("["))


def test_length_and_ignore_eos(llm: LLM) -> None:
    p = _prompt(llm, "Say yes or no.")
    cut, done = llm.generate([p, p], [
        SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=SO(
            json={"type": "object", "properties": {"answer": {"type": "string"}},
                  "required": ["answer"]})),
        # ignore_eos: the grammar's end still ends the sequence (EOS is allowed only there).
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                       structured_outputs=SO(choice=["yes", "no"])),
    ], use_tqdm=False)
    assert cut.outputs[0].finish_reason == "length" and cut.outputs[0].text.startswith("{")
    assert done.outputs[0].finish_reason == "stop" and done.outputs[0].text in ("yes", "no")


def test_unconstrained_neighbours_unchanged(llm: LLM) -> None:
    """A constrained request in the batch leaves the others' greedy tokens as they were alone."""
    p = _prompt(llm, "Name a fruit.")
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate([p], [plain], use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([p, p], [plain, SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=SO(regex="[a-z]+"))], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_slow_compile_neither_spins_nor_stalls(llm: LLM) -> None:
    """While a grammar compiles, an unconstrained request runs to its end, and once only the
    waiting request is left the loop blocks on the compile instead of stepping empty batches."""
    import time

    backend = llm.core.structured.backend
    real = backend.compile
    seen: dict[str, object] = {}

    def slow(params: SO) -> object:
        # Held until the unconstrained request has finished (it must not wait for this), then
        # one more second with only the waiting request left.
        deadline = time.monotonic() + 60
        while "plain" not in seen and time.monotonic() < deadline:
            if all(r.params.structured_outputs is not None
                   for seqs in list(llm.core.scheduler.requests.values()) for r in seqs):
                seen["plain"] = True
            time.sleep(0.01)
        time.sleep(1.0)
        return real(params)

    backend.compile = slow
    try:
        p = _prompt(llm, "Say hi.")
        steps = llm.core.num_steps
        plain, constrained = llm.generate([p, p], [
            SamplingParams(temperature=0.0, max_tokens=4),
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(regex="[a-z]{3}z")),
        ], use_tqdm=False)
        steps = llm.core.num_steps - steps
    finally:
        del backend.compile
    assert len(plain.outputs[0].token_ids) == 4
    assert re.fullmatch("[a-z]{3}z", constrained.outputs[0].text)
    assert seen.get("plain") is True  # the unconstrained request finished during the compile
    assert steps < 200, steps  # 1 s at <= 50 ms a wait, plus the real steps; spinning: thousands


def test_thinking_is_free_and_the_answer_constrained(llm: LLM) -> None:
    """A ``thinking`` gate (a reasoning model's): the tokens up to the end marker are the
    model's own greedy choice, the answer after it follows the grammar; with ``either`` the
    first token may open the thinking (then as above) or start the answer. Markers here are
    ordinary tokens of the embedded model's own greedy output, so the free part is checkable."""
    from fulcrum.sampling_params import ThinkingGate

    tok = llm.get_tokenizer()
    p = _prompt(llm, "Tell me about the sea.")
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    free_ids = list(free[0].outputs[0].token_ids)
    end = free_ids[4]
    k = free_ids.index(end) + 1  # the thinking, its end marker included
    rare = tok.convert_tokens_to_ids("<jupyter_start>")  # never the model's choice
    gates = {
        "thinking": ThinkingGate(rare, end, "thinking"),
        "either, opened": ThinkingGate(free_ids[0], end, "either"),
        "either, answered": ThinkingGate(rare, end, "either"),
        "none": None,
    }
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(
        regex="[0-9]{3}", thinking=g)) for g in gates.values()]  # fmt: skip
    outs = dict(zip(gates, llm.generate([p] * len(gates), params, use_tqdm=False), strict=True))
    for name in ("thinking", "either, opened"):
        ids = list(outs[name].outputs[0].token_ids)
        assert ids[:k] == free_ids[:k], name
        assert re.fullmatch("[0-9]{3}", tok.decode(ids[k:], skip_special_tokens=True)), name
    for name in ("either, answered", "none"):
        assert re.fullmatch("[0-9]{3}", outs[name].outputs[0].text), name
