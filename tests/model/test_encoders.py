"""BERT-family encoders as embedding models (runner pooling): each prompt's pooled hidden states
equal transformers' ``AutoModel`` on the CPU in float32 (BERT, and XLM-RoBERTa with its
position offset), prompts batched whole in one step whatever the budget left; a
sentence-transformers layout picks the pooling; what cannot run is refused by field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fulcrum import LLM
from model_factory import make_tiny_bert_cross_encoder

PROMPTS = [[2, 17, 33, 90, 4, 8, 120, 64, 7, 9, 11, 3], [2, 40, 41, 3], [2, 3], [2, 5, 17, 33, 90, 3]]


def _make(path: str, kind: str, labels: int = 0) -> str:
    """A tiny random encoder (``labels``: its ``...ForSequenceClassification`` instead)."""
    import transformers as tf

    torch.manual_seed(7)
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=40)  # fmt: skip
    if kind == "bert":
        cfg = tf.BertConfig(**common, type_vocab_size=2, num_labels=labels or 2)
        model = tf.BertForSequenceClassification(cfg) if labels else tf.BertModel(cfg)
    else:
        cfg = tf.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1, num_labels=labels or 2)
        model = (tf.XLMRobertaForSequenceClassification(cfg) if labels
                 else tf.XLMRobertaModel(cfg, add_pooling_layer=False))  # fmt: skip
    model.save_pretrained(path)
    return path


def _hf_hidden(path: str) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in PROMPTS]


@pytest.fixture(scope="module", params=["bert", "xlm_roberta"])
def encoder(request, tmp_path_factory) -> tuple[str, list[np.ndarray]]:
    path = _make(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, _hf_hidden(path)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("kind", ["cls", "mean"])
def test_encoder_embeddings_equal_transformers(encoder, kind: str) -> None:
    path, hidden = encoder
    # a 16-token budget: the 12-token prompt leaves too little for the next, which waits
    llm = LLM(path, device="cpu", dtype="float32", pooling_type=kind if kind != "cls" else None,
              max_num_batched_tokens=16)  # fmt: skip
    assert llm.config.model_config.pooler_config.bidirectional  # runner auto: an encoder
    outs = llm.embed(PROMPTS + PROMPTS[:1], use_tqdm=False)
    for o, h in zip(outs, hidden + hidden[:1], strict=True):
        want = _unit(h[0] if kind == "cls" else h.mean(0))
        np.testing.assert_allclose(o.outputs.embedding, want, atol=2e-5, rtol=1e-4)
    assert llm.stats()["prefix_cache_hits"] == 0
    with pytest.raises(ValueError, match="prompt: 17 tokens; this encoder runs each prompt whole"):
        llm.embed([[2] * 17], use_tqdm=False)


def test_encoder_layout_and_refusals(encoder, tmp_path) -> None:
    path, hidden = encoder
    st = tmp_path / "st"
    st.mkdir()
    for f in os.listdir(path):
        os.symlink(os.path.join(path, f), st / f)
    (st / "1_Pooling").mkdir()
    json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
              open(st / "modules.json", "w"))  # fmt: skip
    json.dump({"pooling_mode_mean_tokens": True}, open(st / "1_Pooling" / "config.json", "w"))
    llm = LLM(str(st), device="cpu", dtype="float32")
    out = llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(out, hidden[0].mean(0), atol=2e-5, rtol=1e-4)  # no Normalize
    assert llm.max_model_len == 40 - (2 if "xlm" in str(path) else 0)
    with pytest.raises(ValueError, match="runner: .*Model has no LM head \\(an encoder's"):
        LLM(path, device="cpu", dtype="float32", runner="generate")
    with pytest.raises(ValueError, match="tensor_parallel_size=2: .*Model does not support"):
        LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora_modules: the encoder .* takes no LoRA"):
        LLM(path, device="cpu", dtype="float32", allow_runtime_lora_updates=True)


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta"])
def test_encoder_classifier_equals_transformers(tmp_path, kind: str) -> None:
    """``...ForSequenceClassification`` encoders: the first token through the checkpoint's own
    head (BERT's pooler and classifier, RoBERTa's dense/out_proj) gives transformers' logits."""
    from transformers import AutoModelForSequenceClassification

    path = _make(str(tmp_path / kind), kind, labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=16)
    for o, w in zip(llm.classify(PROMPTS, use_tqdm=False), want, strict=True):
        np.testing.assert_allclose(o.outputs.logits, w, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pooling_type: .* scores the first token"):
        LLM(path, device="cpu", pooling_type="last")


def test_bert_cross_encoder_scores_pairs_by_token_type(tmp_path) -> None:
    """A one-label BERT cross-encoder (ms-marco-MiniLM's layout) scores each (query, document)
    pair read as one prompt, its second text at token type 1 as the tokenizer's pair encoding
    sets it: the sigmoid of transformers' logit on the same pair."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_bert_cross_encoder(str(tmp_path / "ce"))
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "what is the capital of france ?", ["paris is the capital .", "bananas are yellow ."]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        pairs = [tok(query, d, return_tensors="pt") for d in docs]
        want = [torch.sigmoid(hf(**p).logits[0, 0]).item() for p in pairs]
        one_type = [torch.sigmoid(hf(p["input_ids"]).logits[0, 0]).item() for p in pairs]
    assert abs(want[0] - one_type[0]) > 1e-3
    llm = LLM(path, device="cpu", dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
