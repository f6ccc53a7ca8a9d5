"""Frontend side of the core boundary: token ids → text, stop strings, ``RequestOutput`` objects.

Streaming requests get deltas (only the sequences that changed, only their new text and tokens);
the others get one cumulative ``RequestOutput`` when all their ``n`` sequences are finished. A
stop string ends a sequence here; its id goes back to the core to be aborted (``rid#index``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fulcrum.engine.detokenizer import IncrementalDetokenizer
from fulcrum.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    TokenLogprob,
)
from fulcrum.protocol import EngineCoreOutput, Logprobs
from fulcrum.sampling_params import SamplingParams


def sequence_key(request_id: str, index: int) -> str:
    """Id that aborts one sequence of an n > 1 request in the core."""
    return f"{request_id}#{index}"


@dataclass
class _Seq:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # tokens already delivered (streaming)
    sent_logprobs: int = 0


@dataclass
class _ReqState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: list[_Seq]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    pooled: bytes | None = None  # an embedding model's vector (float32 bytes)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _ReqState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        stream: bool = False,
    ) -> None:
        if request_id in self.states:
            raise ValueError(f"request_id: {request_id!r} is already in use.")
        seqs = []
        for i in range(params.n):
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                if self.tokenizer is not None
                else None
            )
            seqs.append(_Seq(i, detok, logprobs=[] if params.logprobs is not None else None))
            if params.logprobs is not None:
                seqs[-1].cumulative_logprob = 0.0
        self.states[request_id] = _ReqState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            stream,
            seqs,
            RequestMetrics(arrival_time if arrival_time is not None else time.time()),
        )

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        now = time.time()
        touched: dict[str, set[int]] = {}
        to_abort: list[str] = []
        for o in _one_token_each(outputs):
            st = self.states.get(o.request_id)
            if st is None or o.index >= len(st.seqs):
                continue
            seq = st.seqs[o.index]
            if seq.finish_reason is not None:
                continue  # already ended by a stop string; the core's abort echo is ignored
            st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
            if o.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = self._prompt_entries(seq, st.prompt_token_ids, o)
            if o.pooled is not None:
                st.pooled = o.pooled
            if o.first_scheduled_time is not None and st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = o.first_scheduled_time
            if o.new_token_ids:
                if st.metrics.first_token_time is None:
                    st.metrics.first_token_time = now
                st.metrics.last_token_time = now
            self._append(seq, o)
            if seq.finish_reason is None and seq.detok is not None and o.new_token_ids:
                stop = seq.detok.update(o.new_token_ids, o.finish_reason is not None)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    if o.finish_reason is None:
                        to_abort.append(sequence_key(o.request_id, o.index))
            elif seq.detok is not None and o.finish_reason is not None and not o.new_token_ids:
                seq.detok.update([], True)
            if seq.finish_reason is None and o.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = o.finish_reason, o.stop_reason
            touched.setdefault(o.request_id, set()).add(o.index)
        results = []
        for rid, idxs in touched.items():
            st = self.states[rid]
            if st.finished:
                st.metrics.finished_time = now
                del self.states[rid]
            if st.stream:
                results.append(self._delta_output(st, sorted(idxs)))
            elif st.finished:
                results.append(self._final_output(st))
        return results, to_abort

    def _append(self, seq: _Seq, o: EngineCoreOutput) -> None:
        seq.token_ids.extend(o.new_token_ids)
        if seq.logprobs is None or not o.new_logprobs:
            return
        for tok, lp in zip(o.new_token_ids, o.new_logprobs, strict=False):
            if lp is None:
                continue
            seq.logprobs.append(self._logprob_entry(seq, tok, lp))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp.token_logprob

    def _logprob_entry(self, seq: _Seq, tok: int, lp: Logprobs) -> dict[int, TokenLogprob]:
        def text(t: int) -> str:
            return seq.detok.decode_token(t) if seq.detok is not None else ""

        entry = {tok: TokenLogprob(tok, lp.token_logprob, lp.token_rank, text(tok))}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1):
            if t not in entry:
                entry[t] = TokenLogprob(t, v, rank, text(t))
        return entry

    def _prompt_entries(
        self, seq: _Seq, prompt: list[int], o: EngineCoreOutput
    ) -> list[dict[int, TokenLogprob] | None]:
        assert o.prompt_logprobs is not None
        lps = zip(prompt[1:], o.prompt_logprobs, strict=False)
        return [None, *(self._logprob_entry(seq, tok, lp) for tok, lp in lps)]

    def _take_prompt_logprobs(self, st: _ReqState) -> list[dict[int, TokenLogprob] | None] | None:
        if st.prompt_logprobs_sent:
            return None
        st.prompt_logprobs_sent = st.prompt_logprobs is not None
        return st.prompt_logprobs

    def _text(self, seq: _Seq) -> str:
        return seq.detok.output_text if seq.detok is not None else ""

    def _delta_output(self, st: _ReqState, idxs: list[int]) -> RequestOutput:
        outs = []
        for i in idxs:
            seq = st.seqs[i]
            done = seq.finish_reason is not None
            text = seq.detok.get_delta(done) if seq.detok is not None else ""
            n_tok = len(seq.token_ids)
            lps = None
            if seq.logprobs is not None:
                lps = seq.logprobs[seq.sent_logprobs :]
                seq.sent_logprobs = len(seq.logprobs)
            outs.append(
                CompletionOutput(
                    i,
                    text,
                    seq.token_ids[seq.sent_tokens : n_tok],
                    seq.finish_reason,
                    seq.stop_reason,
                    lps,
                    seq.cumulative_logprob,
                )
            )
            seq.sent_tokens = n_tok
        return RequestOutput(
            st.request_id,
            st.prompt,
            st.prompt_token_ids,
            outs,
            st.finished,
            st.num_cached_tokens,
            st.metrics,
            prompt_logprobs=self._take_prompt_logprobs(st),
            pooled=st.pooled,
        )

    def _final_output(self, st: _ReqState) -> RequestOutput:
        outs = [
            CompletionOutput(
                s.index,
                self._text(s),
                list(s.token_ids),
                s.finish_reason,
                s.stop_reason,
                s.logprobs,
                s.cumulative_logprob,
            )
            for s in st.seqs
        ]
        return RequestOutput(
            st.request_id,
            st.prompt,
            st.prompt_token_ids,
            outs,
            True,
            st.num_cached_tokens,
            st.metrics,
            prompt_logprobs=st.prompt_logprobs,
            pooled=st.pooled,
        )


def _one_token_each(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Split an output of several tokens (a speculative step's accepted run) into one per
    token, so that a stop string ends the sequence at the token that completes it, as it does
    without speculation, and the tokens after it are dropped."""
    if all(len(o.new_token_ids) <= 1 for o in outputs):
        return outputs
    split: list[EngineCoreOutput] = []
    for o in outputs:
        n = len(o.new_token_ids)
        if n <= 1:
            split.append(o)
            continue
        for i, tok in enumerate(o.new_token_ids):
            last = i == n - 1
            split.append(
                EngineCoreOutput(
                    o.request_id,
                    o.index,
                    [tok],
                    [o.new_logprobs[i]] if o.new_logprobs else None,
                    finish_reason=o.finish_reason if last else None,
                    stop_reason=o.stop_reason if last else None,
                    num_cached_tokens=o.num_cached_tokens,
                    first_scheduled_time=o.first_scheduled_time if i == 0 else None,
                    prompt_logprobs=o.prompt_logprobs if i == 0 else None,
                    pooled=o.pooled if i == 0 else None,
                )
            )
    return split
