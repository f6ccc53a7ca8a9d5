"""Embedding models (runner pooling): each prompt's pooled hidden states equal transformers'
base model's (the decoder without its LM head) on the CPU in float32, over chunked prefill,
prefix-cache hits and both checkpoint layouts (a causal LM's and a bare decoder's)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fulcrum import LLM
from model_factory import make_tiny_classifier

PROMPTS = [
    [5, 17, 33, 90, 4, 8, 120, 64, 7, 9, 11, 250, 3, 18, 44, 71, 2, 6, 99, 100, 31, 12, 13],
    [40, 41, 42],
    [7],
    [5, 17, 33, 90, 4, 8, 120, 64, 7, 9, 11, 250, 3, 18, 44, 71, 200, 201],  # shares 16
]


def _hf_hidden(path: str) -> list[np.ndarray]:
    """transformers' last hidden states (after the final norm) of each prompt, unpadded."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in PROMPTS]


def _pool(h: np.ndarray, kind: str, normalize: bool = True) -> np.ndarray:
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module")
def qwen3(tiny_models) -> tuple[str, list[np.ndarray]]:
    return tiny_models["qwen3"], _hf_hidden(tiny_models["qwen3"])


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_equals_transformers_over_chunks(qwen3, kind: str) -> None:
    path, hidden = qwen3
    # an 8-token step budget: the long prompts take several chunks, batched with others
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, runner="pooling",
              pooling_type=kind, max_num_batched_tokens=8)  # fmt: skip
    # the first prompt twice: its second copy finds its blocks cached (``last`` only)
    outs = llm.embed(PROMPTS + PROMPTS[:1], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS + PROMPTS[:1]
    for o, h in zip(outs, hidden + hidden[:1], strict=True):
        np.testing.assert_allclose(o.outputs.embedding, _pool(h, kind), atol=2e-5, rtol=1e-4)
    assert llm.stats()["generation_tokens_total"] == 0  # the dropped token is not counted
    hits = llm.stats()["prefix_cache_hits"]
    assert (hits > 0) == (kind == "last")  # mean and cls compute every position themselves


def test_bare_decoder_checkpoint_is_an_embedding_model(tmp_path, qwen3) -> None:
    """A ``Qwen3Model`` checkpoint (no LM head, no ``model.`` prefix) serves as one by itself."""
    from transformers import AutoModel

    path, hidden = qwen3
    bare = str(tmp_path / "bare")
    AutoModel.from_pretrained(path, torch_dtype=torch.float32).save_pretrained(bare)
    assert json.load(open(os.path.join(bare, "config.json")))["architectures"] == ["Qwen3Model"]
    llm = LLM(bare, device="cpu", dtype="float32", embedding_normalize="off")
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for o, h in zip(outs, hidden, strict=True):
        np.testing.assert_allclose(o.outputs.embedding, _pool(h, "last", False), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="runner: this model is served by runner pooling"):
        llm.generate(PROMPTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="runner: Qwen3Model has no LM head"):
        LLM(bare, device="cpu", dtype="float32", runner="generate")


def test_dimensions_cut_then_normalize(qwen3) -> None:
    path, hidden = qwen3
    llm = LLM(path, device="cpu", dtype="float32", runner="pooling")
    (out,) = llm.embed(PROMPTS[:1], use_tqdm=False, dimensions=16)
    want = hidden[0][-1][:16]
    np.testing.assert_allclose(out.outputs.embedding, want / np.linalg.norm(want), atol=2e-5, rtol=1e-4)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\]"):
            llm.embed(PROMPTS[:1], use_tqdm=False, dimensions=bad)


def test_sentence_transformers_layout_and_bad_settings(tmp_path, tiny_models) -> None:
    from fulcrum.engine.arg_utils import EngineArgs

    src = tiny_models["llama"]
    st = tmp_path / "st"
    st.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), st / name)
    (st / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    json.dump(modules, open(st / "modules.json", "w"))
    json.dump({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False},
              open(st / "1_Pooling" / "config.json", "w"))  # fmt: skip

    def pooler(**kw):
        args = EngineArgs(str(st), device="cpu", dtype="float32", runner="pooling", **kw)
        return args.create_engine_config().model_config.pooler_config

    pc = pooler()
    assert (pc.pooling_type, pc.normalize) == ("mean", False)  # no Normalize module
    assert pooler(pooling_type="cls", embedding_normalize="on").pooling_type == "cls"
    json.dump({"pooling_mode_max_tokens": True}, open(st / "1_Pooling" / "config.json", "w"))
    with pytest.raises(ValueError, match="pooling_type: .*sets pooling_mode_max_tokens"):
        pooler()
    assert pooler(pooling_type="last").pooling_type == "last"  # named: the file is not read
    with pytest.raises(ValueError, match="pooling_type: applies to runner pooling only"):
        EngineArgs(src, device="cpu", pooling_type="mean").create_engine_config()
    with pytest.raises(ValueError, match="speculative_config: runner pooling"):
        EngineArgs(src, device="cpu", runner="pooling",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                   ).create_engine_config()  # fmt: skip
    llm = LLM(src, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="runner: this model generates text"):
        llm.embed(PROMPTS[:1], use_tqdm=False)


def test_classifier_equals_transformers(tmp_path) -> None:
    """A ``LlamaForSequenceClassification`` serves as a classifier by itself: its score head on
    the last token, chunked prefill; probabilities are the logits' softmax."""
    from transformers import AutoModelForSequenceClassification

    path = make_tiny_classifier(str(tmp_path / "cls"), 3)
    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=8)
    outs = llm.classify(PROMPTS, use_tqdm=False)
    for o, w in zip(outs, want, strict=True):
        np.testing.assert_allclose(o.outputs.logits, w, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(o.outputs.probs, np.exp(w) / np.exp(w).sum(), atol=1e-5)
        assert o.outputs.num_classes == 3
    with pytest.raises(ValueError, match="runner: this model is a classifier"):
        llm.embed(PROMPTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type: LlamaForSequenceClassification scores"):
        LLM(path, device="cpu", pooling_type="mean")


def test_score_cross_encoder_and_embedding_cosine(tmp_path, smollm_dir) -> None:
    """``LLM.score``: a one-label classifier reads each (query, document) pair as one prompt
    and gives its sigmoid; an embedding model gives the cosine of the two embeddings."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    path = make_tiny_classifier(str(tmp_path / "rerank"), 1, vocab=len(tok))
    tok.save_pretrained(path)
    query, docs = "What is the capital of France?", ["Paris is the capital.", "Bananas are yellow."]
    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.sigmoid(hf(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    llm = LLM(path, device="cpu", dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="text_1: pass one text or one per text_2"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    bare = str(tmp_path / "bare")
    AutoModel.from_pretrained(path, torch_dtype=torch.float32).save_pretrained(bare)
    tok.save_pretrained(bare)
    emb = LLM(bare, device="cpu", dtype="float32")
    vecs = [np.array(o.outputs.embedding) for o in emb.embed([query, *docs], use_tqdm=False)]
    got = [o.outputs.score for o in emb.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, [vecs[0] @ vecs[1], vecs[0] @ vecs[2]], atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_reranker_from_label_tokens(tmp_path, smollm_dir, tied: bool) -> None:
    """A reranker kept as a causal LM (Qwen3-Reranker's layout), served as a classifier through
    ``hf_overrides``: the score is the LM head's yes-minus-no logit at the last token, so its
    sigmoid is P(yes) of the two-way softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.15, tie_word_embeddings=tied)  # fmt: skip
    path = str(tmp_path / "lm")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    no, yes = (tok("no", add_special_tokens=False).input_ids[0], tok("yes", add_special_tokens=False).input_ids[0])
    query, docs = "Is Paris in France?", ["Paris is in France.", "Bananas are yellow."]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        last = [hf(**tok(query, d, return_tensors="pt")).logits[0, -1] for d in docs]
    want = [torch.sigmoid(x[yes] - x[no]).item() for x in last]
    over = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    llm = LLM(path, device="cpu", dtype="float32", hf_overrides=over)
    assert llm.config.model_config.pooler_config.label_token_ids == (no, yes)
    np.testing.assert_allclose([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)], want, atol=1e-5)
    if tied:
        return
    with pytest.raises(ValueError, match="classifier_from_token: 'definitely not' is"):
        LLM(path, device="cpu", hf_overrides={**over, "classifier_from_token": ["no", "definitely not"]})
    with pytest.raises(ValueError, match="hf_overrides: expected a JSON object"):
        LLM(path, device="cpu", hf_overrides="[1, 2]")
