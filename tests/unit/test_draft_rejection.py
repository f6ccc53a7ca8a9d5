"""The draft model's pieces: the batched general acceptance rule (a law test: emitted tokens
follow the target's distribution whatever the draft's), its agreement with the per-request
reference, the greedy case, and the draft's configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.spec_decode.batch_rejection import rejection_sample_batch
from fulcrum.spec_decode.draft_model import DraftModelProposer
from fulcrum.worker.draft_verify import draw, row_probs
from fulcrum.worker.sampler import Sampler, SamplingMetadata
from spec_helpers import chi2_ok


def _run(target, draft, n, num_guesses, g):
    """``n`` independent verify steps of one request each (rows of one batch)."""
    k, vocab = draft.shape[0], draft.shape[1]
    d = torch.stack(
        [torch.multinomial(draft[j], n, replacement=True, generator=g) for j in range(k)], 1
    )
    emitted, counts = rejection_sample_batch(
        target.expand(n, k + 1, vocab).contiguous(),
        draft.expand(n, k, vocab).contiguous(),
        d,
        torch.full((n,), num_guesses, dtype=torch.int64),
        1.0 - torch.rand(n, k, generator=g),
        torch.empty(n, vocab).exponential_(generator=g),
    )
    return d, emitted, counts


@pytest.mark.parametrize("num_guesses", [1, 2])
def test_batch_rule_preserves_target_distribution(num_guesses):
    """The first emitted token follows p_0, and the second (when the first guess was kept)
    follows p_1, for a draft distribution far from the target's."""
    g = torch.Generator().manual_seed(2)
    vocab, n, k = 6, 40000, 2
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, 1)
    draft = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, 1)
    draft[0, 3] = 0.0  # a token the draft never proposes still reaches its target mass
    draft = draft / draft.sum(1, keepdim=True)
    d, emitted, counts = _run(target, draft, n, num_guesses, g)
    assert int(counts.min()) >= 1 and int(counts.max()) <= num_guesses + 1
    kept = counts - 1
    assert torch.equal(emitted[:, :1][kept >= 1], d[:, :1][kept >= 1])  # kept guesses come first
    first = np.bincount(emitted[:, 0].numpy(), minlength=vocab)
    assert chi2_ok(first, target[0].numpy(), n)
    two = counts >= 2
    second = np.bincount(emitted[two, 1].numpy(), minlength=vocab)
    assert chi2_ok(second, target[1].numpy(), int(two.sum()))
    # the first guess is kept with probability sum(min(p, q))
    rate = float((kept >= 1).float().mean())
    assert rate == pytest.approx(float(torch.minimum(target[0], draft[0]).sum()), abs=0.015)


def test_batch_rule_greedy_rows_and_no_guesses():
    vocab = 8
    hot = lambda ids: torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()  # noqa: E731
    target = torch.stack([hot([3, 5, 1]), hot([2, 2, 2]), hot([4, 6, 7])])  # argmaxes per row
    draft = torch.stack([hot([3, 5]), hot([2, 7]), hot([0, 0])])
    tokens = torch.tensor([[3, 5], [2, 7], [0, 0]])
    emitted, counts = rejection_sample_batch(
        target, draft, tokens, torch.tensor([2, 2, 0]), torch.ones(3, 2), torch.ones(3, vocab)
    )
    assert counts.tolist() == [3, 2, 1]
    assert emitted[0].tolist() == [3, 5, 1]  # all kept, then the target's next
    assert emitted[1, :2].tolist() == [2, 2]  # second guess rejected: the target's argmax
    assert emitted[2, 0].item() == 4  # no guesses: the target's own token


def test_row_probs_follows_the_sampler():
    """The distributions verified against are the sampler's: greedy rows one-hot, random rows
    temperature/top-k/top-p, and a draw from them is a draw of the sampler's law."""
    from fulcrum.protocol import WireSamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    params = [
        WireSamplingParams(temperature=0.0),
        WireSamplingParams(temperature=0.7, top_k=5),
        WireSamplingParams(temperature=1.3, top_p=0.8),
    ]
    meta = SamplingMetadata.build(params, [None] * 3, [[]] * 3, None, 50, "cpu")
    probs = row_probs(logits, meta)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 50).float())
    assert int((probs[1] > 0).sum()) == 5
    want = Sampler.random_probs(
        logits[1:], SamplingMetadata.build(params[1:], [None] * 2, [[]] * 2, None, 50, "cpu")
    )
    torch.testing.assert_close(probs[1:], want)
    assert draw(probs, {}).shape == (3,) and int(draw(probs, {})[0]) == int(logits[0].argmax())


def test_proposer_hands_out_placeholders():
    p = DraftModelProposer(4)
    assert p.propose("r", [1, 2, 3], 2) == [0, 0] and len(p.propose("r", [1], 9)) == 4


def _args(tiny_models, **spec) -> EngineArgs:
    return EngineArgs(
        model=tiny_models["llama"],
        device="cpu",
        speculative_config={"method": "draft_model", **spec},
    )


def test_draft_config_errors_name_the_field(tiny_models, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(ValueError, match="speculative_config.model: model: '/nonexistent'"):
        _args(tiny_models, model="/nonexistent").create_engine_config()
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "v256"))
    with pytest.raises(
        ValueError, match="speculative_config.model: the draft's vocabulary has 256"
    ):
        _args(tiny_models, model=str(tmp_path / "v256")).create_engine_config()
    ok = _args(tiny_models, model=tiny_models["mistral"]).create_engine_config()
    assert ok.draft_model_config is not None and ok.draft_model_config.vocab_size == 320


def test_serve_exits_2_naming_the_draft(capsys):
    pytest.importorskip("fulcrum.entrypoints.openai.cli_serve")
    from fulcrum.entrypoints.cli import main

    spec = '{"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 3}'
    rc = main(["serve", "--speculative-config", spec])
    err = capsys.readouterr().err
    assert rc == 2 and "speculative_config.model" in err, err
