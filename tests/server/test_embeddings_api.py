"""POST /v1/embeddings with the official client: the embedded model served with ``--runner
pooling`` gives transformers' last-token hidden states (normalized) for text and token-id
inputs, as floats and as base64; bad input is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from srv_helpers import API_KEY, MODEL, Server, start_server, stop_server

TEXTS = ["The capital of France is", "def fib(n):\n    return"]


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # a small KV pool: this server runs beside the session's shared one
    s = start_server(str(tmp_path_factory.mktemp("embed")), "--api-key", API_KEY,
                     "--max-model-len", "64", "--runner", "pooling", "--kv-cache-memory", "0.05")  # fmt: skip
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def reference(smollm_dir, smollm_tokenizer) -> list[np.ndarray]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(smollm_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([smollm_tokenizer(text).input_ids])
            out.append(model(ids).last_hidden_state[0, -1].numpy())
    return out


def _client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_embeddings_equal_transformers(pooling_server: Server, reference, smollm_tokenizer) -> None:
    client = _client(pooling_server)
    # the client asks for base64 by default and decodes it
    res = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in res.data] == [0, 1] and res.model == MODEL
    for d, ref in zip(res.data, reference, strict=True):
        np.testing.assert_allclose(d.embedding, _unit(ref), atol=1e-4)
    n = sum(len(smollm_tokenizer(t).input_ids) for t in TEXTS)
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)
    ids = smollm_tokenizer(TEXTS[1]).input_ids
    for inp in (ids, [ids]):  # token ids, one list or a list of lists
        res = client.embeddings.create(model=MODEL, input=inp, encoding_format="float")
        np.testing.assert_allclose(res.data[0].embedding, _unit(reference[1]), atol=1e-4)
    res = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32, encoding_format="float")
    np.testing.assert_allclose(res.data[0].embedding, _unit(reference[0][:32]), atol=1e-4)


def test_embeddings_bad_input(pooling_server: Server, server: Server) -> None:
    def post(srv: Server, path: str, body: dict) -> tuple[int, dict]:
        return srv.json("POST", path, body)

    cases = [
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": ""}, "input"),
        ({"model": MODEL, "input": "hi", "dimensions": 0}, "dimensions"),
        ({"model": MODEL, "input": "hi", "dimensions": 577}, "dimensions"),
        ({"model": MODEL, "input": [1] * 64}, "input"),
        ({"model": MODEL, "input": [49152]}, "input"),
        ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        code, err = post(pooling_server, "/v1/embeddings", body)
        assert code == 400, (body, err)
        assert param in (err["error"].get("param") or ""), (body, err)
    code, err = post(pooling_server, "/v1/embeddings", {"model": "nope", "input": "hi"})
    assert code == 404 and err["error"]["param"] == "model"
    # cut to the last 8 tokens: fits
    code, ok = post(pooling_server, "/v1/embeddings", {"input": [1] * 80, "truncate_prompt_tokens": 8})
    assert code == 200 and ok["usage"]["prompt_tokens"] == 8
    # a text endpoint on the embedding server, and embeddings on the text server
    code, err = post(pooling_server, "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert code == 400 and err["error"]["param"] == "model" and "/v1/embeddings" in err["error"]["message"]
    code, err = post(server, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert code == 400 and err["error"]["param"] == "model" and "--runner pooling" in err["error"]["message"]


def test_score_and_rerank_by_embedding_cosine(pooling_server: Server) -> None:
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain."]
    code, emb = pooling_server.json("POST", "/v1/embeddings", {"input": [TEXTS[0], *docs]})
    assert code == 200
    vecs = [np.array(d["embedding"]) for d in emb["data"]]
    want = [float(vecs[0] @ v) for v in vecs[1:]]  # unit vectors: the cosine
    code, res = pooling_server.json("POST", "/v1/score", {"text_1": TEXTS[0], "text_2": docs})
    assert code == 200 and [d["index"] for d in res["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in res["data"]], want, atol=1e-5)
    code, res = pooling_server.json("POST", "/v1/rerank", {"query": TEXTS[0], "documents": docs, "top_n": 2})
    assert code == 200 and len(res["results"]) == 2
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in res["results"]] == best
    assert res["results"][0]["document"]["text"] == docs[best[0]]
    code, err = pooling_server.json("POST", "/classify", {"input": "hi"})
    assert code == 400 and err["error"]["param"] == "model"
    code, err = pooling_server.json("POST", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert code == 400 and err["error"]["param"] == "text_1"
    code, err = pooling_server.json("POST", "/v1/rerank", {"query": "q", "documents": []})
    assert code == 400 and "documents" in err["error"]["param"]


@pytest.fixture(scope="module")
def classifier_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    from model_factory import make_tiny_bert_cross_encoder

    tmp = tmp_path_factory.mktemp("classifier")
    path = make_tiny_bert_cross_encoder(str(tmp / "model"))
    s = start_server(str(tmp), "--api-key", API_KEY, "--model", path, "--served-model-name", "rr",
                     "--kv-cache-memory", "0.05")  # fmt: skip
    yield s, path
    stop_server(s)


def test_classifier_server_reranks_like_transformers(classifier_server) -> None:
    """A one-label BERT cross-encoder (ms-marco-MiniLM's layout): each (query, document) pair
    is one prompt, its second text at token type 1; scores are transformers' sigmoid; /classify
    gives the probability. (A decoder classifier serves the same way: tests/model.)"""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, path = classifier_server
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    query, docs = "capital of France ?", ["Paris is the capital .", "Bananas are yellow .", "Rome"]
    with torch.no_grad():
        logits = [hf(**tok(query, d, return_tensors="pt")).logits[0, 0].item() for d in docs]
    want = [1 / (1 + np.exp(-x)) for x in logits]
    code, res = server.json("POST", "/v1/rerank", {"model": "rr", "query": query, "documents": docs,
                                                    "return_documents": False})  # fmt: skip
    assert code == 200, res
    assert [r["index"] for r in res["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert "document" not in res["results"][0]
    np.testing.assert_allclose([r["relevance_score"] for r in sorted(res["results"], key=lambda r: r["index"])],
                               want, atol=1e-5)  # fmt: skip
    code, res = server.json("POST", "/score", {"text_1": query, "text_2": docs[0]})
    assert code == 200 and abs(res["data"][0]["score"] - want[0]) < 1e-5
    code, res = server.json("POST", "/classify", {"input": [query]})
    assert code == 200 and res["data"][0]["num_classes"] == 1 and res["data"][0]["label"] == "LABEL_0"
    code, err = server.json("POST", "/v1/embeddings", {"input": "hi"})
    assert code == 400 and err["error"]["param"] == "model"
