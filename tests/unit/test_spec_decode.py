"""Proposers, the acceptance rule (a law test: the emitted tokens follow the target
distribution), the configuration's errors and the scheduler's rollback of rejected guesses."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from fulcrum.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from fulcrum.engine.arg_utils import EngineArgs, parse_speculative_config
from fulcrum.protocol import EngineCoreRequest, WireSamplingParams
from fulcrum.scheduler.scheduler import Scheduler
from fulcrum.spec_decode import accept_point_mass, make_proposer, rejection_sample
from fulcrum.spec_decode.ngram import ngram_lookup
from fulcrum.spec_decode.proposer import TokenArrays
from fulcrum.spec_decode.suffix import OutputCorpus, SuffixProposer, propose_in_text
from spec_helpers import SuffixTrie, chi2_ok

# -- proposers ----------------------------------------------------------------------------------


def test_ngram_longest_then_latest_match():
    t = np.array([1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 1, 2, 3])
    # "1 2 3" (n=3) occurred at 0, followed by 9 8 2
    assert ngram_lookup(t, 1, 3, 3) == [9, 8, 2]
    # with n <= 2 the latest "2 3" wins: at 5, followed by 7 6
    assert ngram_lookup(t, 1, 2, 2) == [7, 6]
    assert ngram_lookup(np.array([4, 5, 6]), 1, 3, 4) == []
    assert ngram_lookup(np.array([4, 4]), 1, 3, 4) == [4]  # continuation cut at the end
    assert ngram_lookup(t, 1, 3, 0) == []


@pytest.mark.parametrize("min_n,max_n", [(2, 4), (1, 1), (1, 3), (3, 5)])
def test_ngram_matches_brute_force(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    for _ in range(300):
        t = rng.integers(0, 4, rng.integers(1, 30))
        got = ngram_lookup(t, min_n, max_n, 3)
        want: list[int] = []
        for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
            hits = [i for i in range(len(t) - n) if list(t[i : i + n]) == list(t[-n:])]
            if hits:
                want = list(t[hits[-1] + n : hits[-1] + n + 3])
                break
        assert got == want, (t.tolist(), min_n, max_n)


@pytest.mark.parametrize("max_depth,k,factor,min_prob", [(3, 4, 1.0, 0.1), (8, 5, 2.0, 0.0),
                                                          (24, 8, 1.0, 0.1), (5, 3, 0.5, 0.4)])  # fmt: skip
def test_suffix_walk_over_the_array_equals_the_trie(max_depth, k, factor, min_prob):
    """The request's own text is searched on its token array: the same guesses and score as
    the trie of that text would give, ties and depth cut included."""
    rng = np.random.default_rng(max_depth * 100 + k)
    for _ in range(300):
        t = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 60)))
        trie = SuffixTrie(max_depth)
        trie.extend(t.tolist())
        want = trie.propose(t.tolist()[-max_depth:], k, factor, min_prob)
        assert propose_in_text(t, max_depth, k, factor, min_prob) == want, t.tolist()


def test_output_corpus_equals_the_trie_of_its_texts():
    """Finished outputs in one indexed buffer propose what the trie of the same texts does,
    after removals too (the buffer compacted, its index rebuilt), for contexts that match
    within texts and never across two."""
    rng = np.random.default_rng(7)
    for trial in range(6):
        depth = int(rng.integers(3, 10))
        texts = {str(i): rng.integers(0, 4, int(rng.integers(1, 120))).tolist() for i in range(90)}
        corpus = OutputCorpus()
        for key, t in texts.items():
            corpus.add(key, t)
        if trial % 2:  # remove most: past the compaction threshold
            for key in list(texts)[: int(rng.integers(40, 85))]:
                corpus.remove(key)
                del texts[key]
        trie = SuffixTrie(depth)
        for t in texts.values():
            trie.extend(t)
            trie.end_text()
        for _ in range(60):
            ctx = rng.integers(0, 4, int(rng.integers(1, 2 * depth)))
            want = trie.propose(ctx.tolist()[-depth:], 4, 1.5, 0.05)
            assert corpus.propose(ctx, depth, 4, 1.5, 0.05) == want, (trial, ctx.tolist())


def test_output_corpus_holds_no_python_objects_per_token():
    """Finished outputs live in arrays: the garbage collector's object count does not grow
    with their tokens (a trie of nodes held millions and paused the engine's loop for seconds)."""
    import gc

    rng = np.random.default_rng(3)
    sp = SuffixProposer(max_depth=24, max_cached_requests=1000, spec_factor=1.0, min_prob=0.1)
    sp.on_finished("warm", rng.integers(0, 30000, 50).tolist(), 0)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(300):
        sp.on_finished(str(i), rng.integers(0, 30000, 200).tolist(), 0)
    gc.collect()
    assert len(gc.get_objects()) - before < 2000  # a few per finished request, not per token
    assert len(sp.outputs) == 301


def test_token_arrays_follow_growing_sequences():
    """The proposers' per-request arrays: equal to the ids after each step's appends, rebuilt
    for a shorter history, gone when the sequence ends."""
    arrays = TokenArrays()
    ids = list(range(50))
    assert arrays.get("a", ids).tolist() == ids
    for step in range(40):  # past the first buffer's capacity
        ids += [step, step + 1000]
        assert arrays.get("a", ids).tolist() == ids
    assert arrays.get("a", ids[:10]).tolist() == ids[:10]  # recomputed from a shorter history
    assert arrays.get("b", [7]).tolist() == [7]
    arrays.drop("a")
    assert "a" not in arrays._arrays and arrays.get("a", [1, 2]).tolist() == [1, 2]


def test_suffix_proposer_own_and_global_tree():
    sp = SuffixProposer(max_depth=8, max_cached_requests=2, spec_factor=2.0, min_prob=0.1)
    # its own history: "5 6 7 8" occurred, the context ends in "5 6"
    assert sp.propose("a", [5, 6, 7, 8, 1, 5, 6], 3) == [7, 8, 1]
    # a new request ending in what an earlier one produced gets that output
    sp.on_finished("a", [0, 0, 40, 41, 42, 43, 44], 2)
    assert sp.propose("b", [9, 9, 40, 41], 3) == [42, 43, 44]
    # evicted from the global tree after max_cached_requests newer outputs
    sp.on_finished("c", [1, 2, 3], 0)
    sp.on_finished("d", [4, 5, 6], 0)
    assert sp.propose("e", [9, 9, 40, 41], 3) == []
    # the most frequent continuation wins; min_prob cuts unlikely tails
    sp2 = SuffixProposer(max_depth=8, max_cached_requests=0, spec_factor=4.0, min_prob=0.5)
    hist = [1, 2, 1, 3, 1, 2, 9, 1]
    assert sp2.propose("x", hist, 4)[0] == 2


def test_make_proposer_methods():
    for m in ("ngram", "suffix"):
        assert make_proposer(SpeculativeConfig(method=m)).propose("k", [1, 2, 1, 2], 2) == [1, 2]


# -- acceptance -----------------------------------------------------------------------------


def test_accept_point_mass():
    assert accept_point_mass([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept_point_mass([5, 9, 7], [5, 6]) == [5, 9]
    assert accept_point_mass([4, 6, 7], [5, 6]) == [4]
    assert accept_point_mass([3], []) == [3]


def test_point_mass_rule_preserves_distribution():
    """First emitted token and the second given the first agree with the target's law, for a
    guess drawn from anything (here: a fixed guess, the point-mass proposal)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 20000
    p0 = torch.softmax(torch.randn(vocab, generator=g), 0)
    p1 = torch.softmax(torch.randn(vocab, generator=g), 0)
    guess = [int(p0.argmax()), 2]
    x0 = torch.multinomial(p0, n, replacement=True, generator=g)
    x1 = torch.multinomial(p1, n, replacement=True, generator=g)
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    for a, b in zip(x0.tolist(), x1.tolist(), strict=True):
        out = accept_point_mass([a, b, 0], guess)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi2_ok(first, p0.numpy(), n)
    assert chi2_ok(second, p1.numpy(), int(second.sum()))


def test_general_rejection_sampling_preserves_distribution():
    g = torch.Generator().manual_seed(1)
    vocab, n, k = 5, 8000, 2
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, 1)
    draft = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, 1)
    first = np.zeros(vocab)
    accepted = 0
    for _ in range(n):
        d = torch.stack([torch.multinomial(draft[j], 1, generator=g)[0] for j in range(k)])
        out = rejection_sample(target, draft, d, g)
        assert 1 <= len(out) <= k + 1
        first[out[0]] += 1
        accepted += len(out) - 1
    assert chi2_ok(first, target[0].numpy(), n)
    # acceptance rate of the first guess is sum(min(p, q))
    assert accepted > 0


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "medusa"}, "speculative_config.method"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"nope": 1}, "unknown key 'nope'"),
        ({"num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
        ("{not json", "speculative_config: not valid JSON"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        parse_speculative_config(value)


def test_cli_flag_parses_and_rejects(capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    spec = {"method": "suffix", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    args = parser.parse_args(["--speculative-config", json.dumps(spec)])
    cfg = EngineArgs.from_cli_args(args).speculative_config
    assert cfg == SpeculativeConfig(
        method="suffix", num_speculative_tokens=3, disable_by_batch_size=8
    )
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--speculative-config", '{"method": "x"}'])
    assert e.value.code == 2
    assert "speculative_config.method" in capsys.readouterr().err


def test_budget_too_small_names_the_field():
    args = EngineArgs(
        model=None, speculative_config={"num_speculative_tokens": 8}, max_num_batched_tokens=8
    )
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        args.create_engine_config()


# -- scheduler ------------------------------------------------------------------------------


def _sched(k: int = 4, block_size: int = 4, num_blocks: int = 32, **kw) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, **kw)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        num_blocks,
        100,
        {0},
        spec_config=spec,
    )


def _add(s: Scheduler, rid: str, prompt: list[int], **sp) -> None:
    s.add_request(EngineCoreRequest(rid, prompt, WireSamplingParams(temperature=0, **sp)))


def test_scheduler_verify_step_and_rollback():
    s = _sched()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]  # "1 2 3" seen before: guesses 4 5 1 2
    _add(s, "r", prompt, max_tokens=50)
    out = s.schedule()  # prefill
    s.update(out, [4])
    req = s.running[0]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"r#0": [5, 1, 2, 3]}
    assert out.num_scheduled_tokens == [5] and out.samples == [True]
    assert req.num_computed_tokens == 9 + 4
    blocks_before = len(s.kv.block_table("r#0"))
    assert blocks_before == 4  # 13 tokens
    # the target agrees with 5 only, then says 7: two tokens emitted
    res = s.update(out, [5, 7], num_tokens=[2])
    assert res[0].new_token_ids == [5, 7]
    assert req.all_token_ids == prompt + [4, 5, 7]
    assert req.num_computed_tokens == 10 == req.num_tokens - 1
    assert len(s.kv.block_table("r#0")) == 3  # the guesses' last block is freed
    stats = s.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 4)
    assert stats.spec_decode_num_accepted_tokens == 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0, 0]
    # the runner is told where the table continues
    out = s.schedule()
    assert out.scheduled_cached_reqs.block_offsets == [3]
    s.kv.check_integrity()


def test_scheduler_guess_limits_and_stop_inside_run():
    s = _sched(k=4, disable_by_batch_size=1)
    _add(s, "a", [1, 2, 3, 1, 2], max_tokens=3)
    s.update(s.schedule(), [3])  # prefill -> a has 1 output
    out = s.schedule()
    # max_tokens 3: one output so far, so at most one guess beyond the next token
    assert [len(d) for d in out.scheduled_spec_decode_tokens.values()] == [1]
    res = s.update(out, [1, 2], num_tokens=[1])
    assert res[0].new_token_ids == [1]
    # a second running request exceeds disable_by_batch_size: no guesses
    _add(s, "b", [1, 2, 1, 2], max_tokens=5)
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    s.update(out, [9, 9])
    # stop token inside an accepted run: the tokens after it are dropped
    s2 = _sched()
    _add(s2, "c", [1, 2, 3, 1, 2], max_tokens=20)
    s2.update(s2.schedule(), [3])
    out = s2.schedule()
    drafts = out.scheduled_spec_decode_tokens["c#0"]
    res = s2.update(out, [*drafts[:1], 0], num_tokens=[2])  # 0 is EOS
    assert res[0].new_token_ids == [drafts[0], 0] and res[0].finish_reason == "stop"
    assert not s2.has_unfinished()
    s2.kv.check_integrity()


# -- metrics --------------------------------------------------------------------------------


def test_metrics_exposed_and_bench_reads_acceptance_length():
    pytest.importorskip("prometheus_client")
    from fulcrum.bench.server_metrics import parse_prometheus, summarize
    from fulcrum.entrypoints.openai.metrics import ServerMetrics
    from fulcrum.protocol import SchedulerStats

    m = ServerMetrics("m")
    m.on_stats(SchedulerStats())
    before = parse_prometheus(m.render().decode())
    m.on_stats(
        SchedulerStats(
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=40,
            spec_decode_num_accepted_tokens=25,
            spec_decode_num_accepted_tokens_per_pos=[9, 7, 5, 4],
        )
    )
    text = m.render().decode()
    assert 'fulcrum:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert 'fulcrum:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'fulcrum:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0' in text
    assert (
        'fulcrum:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0'
        in text
    )
    fig = summarize([before, parse_prometheus(text)])
    assert fig is not None and fig.spec_decode_mean_acceptance_length == pytest.approx(3.5)
    assert summarize([before, before]).spec_decode_mean_acceptance_length is None


def test_serve_exits_2_naming_the_field(capsys):
    pytest.importorskip("fulcrum.entrypoints.openai.cli_serve")
    from fulcrum.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative-config", '{"method": "medusa"}'])
    assert e.value.code == 2
    assert "speculative_config.method" in capsys.readouterr().err
    rc = main(
        [
            "serve",
            "--speculative-config",
            '{"num_speculative_tokens": 8}',
            "--max-num-batched-tokens",
            "8",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "speculative_config.num_speculative_tokens" in err
    assert err.strip().startswith("fulcrum serve: error:")
