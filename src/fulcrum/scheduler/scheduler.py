"""Continuous batching under one token budget per step.

Each step hands out ``max_num_batched_tokens``: running requests first (a decode costs 1 token, an
unfinished prompt a chunk of what is left), then waiting ones in policy order. When blocks run
out, the newest running request is preempted: its blocks are freed, it goes back to the front of
the queue with its output kept, and is recomputed later (its prefix usually still cached).

``schedule`` commits what it hands out (``num_computed_tokens`` advances, full blocks enter the
prefix cache, a sampling request gets a pending token), so the next step can be scheduled while
this one still runs on the device; ``update`` later appends the sampled tokens and applies stop
conditions. A request known to finish by length when its pending token lands is not scheduled
again; one that stops on a stop token wastes at most the one step already launched.

Speculative decoding is the same rule: a decoding request's proposer guesses k tokens, and the
request is scheduled for 1 + k tokens of the budget (``num_computed_tokens`` advances over all
of them); ``update`` appends the verified ones and moves ``num_computed_tokens`` back over the
rejected guesses, whose blocks are freed. Only verified tokens are in ``all_token_ids``, so the
radix cache never sees a guess. Steps with guesses run one at a time (``overlap_safe`` is False
while speculation is on): a guess is proposed from the tokens before it, and with a step in
flight those are not known yet.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from fulcrum.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from fulcrum.kv_cache.manager import KVCacheManager
from fulcrum.lora.registry import LoRARegistry
from fulcrum.protocol import EngineCoreOutput, EngineCoreRequest, Logprobs, SchedulerStats
from fulcrum.request import Request, RequestStatus
from fulcrum.scheduler.grammar import (
    advance_matchers,
    attach_matcher,
    blocking_grammars,
    sampled_matchers,
)
from fulcrum.scheduler.output import NewRequestData, SchedulerOutput
from fulcrum.scheduler.policy import order_waiting
from fulcrum.scheduler.speculation import propose_for
from fulcrum.spec_decode.registry import make_proposer
from fulcrum.spec_decode.stats import SpecDecodeStats
from fulcrum.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        vocab_size: int,
        eos_token_ids: set[int],
        structured: StructuredOutputManager | None = None,
        spec_config: SpeculativeConfig | None = None,
        kv_window: int | None = None,  # every layer's window: older KV blocks are released
        loras: LoRARegistry | None = None,  # the adapters served (None: none)
        whole_prompt: bool = False,  # every prompt position computed (mean/cls pooling)
        unchunked: bool = False,  # each prompt in one step (an encoder attends both ways)
        host_blocks: int = 0,  # the prefix cache's host tier (kv_cache/host_tier.py)
    ) -> None:
        self.config = config
        self.loras = loras if loras is not None else LoRARegistry(LoRAConfig())
        self.whole_prompt = whole_prompt
        self.unchunked = unchunked
        self.structured = structured
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_window,
            host_blocks,
        )  # fmt: skip
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}
        self._aborted: list[Request] = []
        self._finished_keys: list[str] = []  # for the runner, with the next step
        self._steps: dict[int, list[Request]] = {}  # scheduled steps not yet updated
        self._next_step_id = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_config = spec_config
        self.proposer = make_proposer(spec_config) if spec_config is not None else None
        self.spec_stats = SpecDecodeStats(spec_config.num_speculative_tokens if spec_config else 0)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        prompt, sp, max_len = req.prompt_token_ids, req.sampling_params, self.config.max_model_len
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already running.")
        if not prompt:
            raise ValueError("prompt: the prompt is empty.")
        if len(prompt) >= max_len:
            raise ValueError(
                f"prompt: {len(prompt)} prompt tokens leave no room to generate within "
                f"max_model_len={max_len}."
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})."
            )
        need = -(-(len(prompt) + 1) // self.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt: {len(prompt)} tokens need {need} KV blocks; the cache has "
                f"{self.kv.num_blocks}."
            )
        if sp.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {sp.max_tokens}.")
        if self.unchunked and len(prompt) > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt: {len(prompt)} tokens; this encoder runs each prompt whole in one step "
                f"of at most max_num_batched_tokens={self.config.max_num_batched_tokens}."
            )
        words = [t for w in sp.bad_words_token_ids for t in w]
        for name, ids in (("logit_bias", sp.logit_bias), ("allowed_token_ids", sp.allowed_token_ids),
                          ("bad_words", words)):  # fmt: skip
            bad = [t for t in ids or () if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})."
                )
        lora_slot, salt = 0, req.cache_salt
        if req.lora is not None:  # an adapter's KV differs from the base model's: its own cache
            lora_slot = self.loras.slot(req.lora)
            salt = f"{salt or ''}\x00{self.loras.cache_salt(req.lora)}"
        sp.all_stop_token_ids = sorted(self.eos_token_ids)
        grammar = None
        if sp.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs: this engine has no tokenizer to compile grammars for.")
            grammar = self.structured.submit(sp.structured_outputs)
        seqs: list[Request] = []
        for i in range(sp.n):
            seqs.append(
                Request(
                    req.request_id, i, list(prompt), sp, self.eos_token_ids, req.arrival_time,
                    salt, req.priority, parent=seqs[0] if i else None,
                )
            )
            seqs[-1].lora_slot = lora_slot
            seqs[-1].grammar = grammar
        self.requests[req.request_id] = seqs
        self.waiting.extend(seqs)

    def holds_lora_slot(self, slot: int) -> bool:
        """Whether an unfinished request runs the adapter in ``slot``."""
        return any(
            s.lora_slot == slot and not s.status.finished
            for seqs in self.requests.values()
            for s in seqs
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort whole requests by id, or one sequence of an n > 1 request as ``rid#index``."""
        for rid in request_ids:
            seqs = self.requests.get(rid)
            if seqs is None and "#" in rid:
                base, _, idx = rid.rpartition("#")
                group = self.requests.get(base, [])
                seqs = [s for s in group if idx.isdigit() and s.index == int(idx)]
            for r in seqs or []:
                if r.status.finished:
                    continue
                if r.status == RequestStatus.RUNNING:
                    self.running.remove(r)
                else:
                    self.waiting.remove(r)
                self.kv.free(r.key)
                r.status = RequestStatus.FINISHED_ABORTED
                self._on_finished(r)
                self._aborted.append(r)
                self._finished_keys.append(r.key)
                self._drop_if_done(r.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def overlap_safe(self) -> bool:
        """No running request's sampling needs host-side history (penalties, min_tokens), so
        the next step may be scheduled before this one's tokens are known. With speculation,
        only where the next step makes no guesses anyway: n-gram and suffix guesses follow the
        last token, and a batch larger than ``disable_by_batch_size`` gets none. A draft model
        reads every token from the host, so it never overlaps."""
        if not all(r.overlap_safe for r in self.running):
            return False
        sc = self.spec_config
        return sc is None or (
            sc.method != "draft_model" and len(self.running) > sc.disable_by_batch_size
        )

    # -- scheduling ---------------------------------------------------------------------------

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim.key)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(step_id=self._next_step_id, finished_req_ids=self._finished_keys)
        self._finished_keys = []
        reqs: list[Request] = []
        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_pending - req.num_computed_tokens, budget)
            if num_new <= 0 or self._finishes_by_length(req):
                i += 1
                continue
            drafts = self._propose(req, budget) if num_new == 1 else []
            if drafts and not self.kv.allocate_slots(
                req.key, req.num_computed_tokens + 1 + len(drafts)
            ):
                drafts = []  # no room for guesses: a plain decode (which may preempt)
            num_new += len(drafts)
            while not self.kv.allocate_slots(req.key, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.key)
                if victim is req:
                    break
            else:
                self._commit(out, reqs, req, num_new, drafts=drafts)
                budget -= num_new
                i += 1
                continue
            break
        # 2. Waiting requests, unless this step had to preempt.
        if not out.preempted_req_ids:
            self._schedule_waiting(out, reqs, budget)
        if reqs:
            self._steps[out.step_id] = reqs
        if not out.is_empty:  # (an empty step runs nothing: its copies wait for the next)
            out.kv_copies = self.kv.take_copies()
        self._next_step_id += 1
        return out

    def _grammar_ready(self, req: Request) -> bool:
        ready = attach_matcher(req)
        if isinstance(ready, BaseException):
            logger.error("request %s: grammar compile failed: %s", req.key, ready)
            self.abort_requests([req.key])
            return False
        return ready

    def blocking_grammars(self) -> list:
        """The compiles every remaining request waits on (empty unless nothing else can run):
        the core then blocks on them instead of stepping an empty schedule in a loop."""
        return [] if self.running or self._aborted else blocking_grammars(self.waiting)

    def needs_bitmask(self, out: SchedulerOutput) -> bool:
        """Whether a sampled row of this step has a grammar."""
        reqs = self._steps.get(out.step_id, [])
        return any(r.matcher is not None for r, s in zip(reqs, out.samples, strict=True) if s)

    def grammar_bitmask(self, out: SchedulerOutput) -> None:
        """Fill ``out.grammar_bitmask`` from each sampled row's matcher. Called once the tokens
        of every earlier step are in (the core collects the previous step first), while the
        device runs this step's forward; a row whose request ended meanwhile allows all."""
        if self.structured is None:
            return
        rows = sampled_matchers(self._steps.get(out.step_id, []), out)
        if any(m is not None for m in rows):
            out.grammar_bitmask = self.structured.bitmask(rows)

    def _finishes_by_length(self, req: Request) -> bool:
        """The pending token will end the request (max_tokens / max_model_len): nothing to run."""
        if not req.num_pending:
            return False
        n = req.num_tokens_with_pending
        return n - req.num_prompt_tokens >= req.params.max_tokens or n >= self.config.max_model_len

    def _propose(self, req: Request, budget: int) -> list[int]:
        if self.proposer is None or self.spec_config is None:
            return []
        return propose_for(
            self.proposer, self.spec_config, req, budget, len(self.running),
            self.config.max_model_len,
        )

    def _commit(
        self,
        out: SchedulerOutput,
        reqs: list[Request],
        req: Request,
        num_new: int,
        new: bool = False,
        drafts: list[int] | None = None,
    ) -> None:
        """Add ``req`` to the step (whole, if ``new`` to the runner; else what changed since its
        last step) and advance it as if the step had already run."""
        start = req.num_computed_tokens
        drafts = drafts or []
        if drafts:
            out.scheduled_spec_decode_tokens[req.key] = drafts
        req.spec_token_ids = drafts
        samples = start + num_new - len(drafts) == req.num_tokens_with_pending
        self.kv.free_out_of_window(req.key, start)
        blocks = self.kv.block_table(req.key)
        if new:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req.key, req.index, req.prompt_token_ids, req.output_token_ids, req.params,
                    list(blocks), start, req.lora_slot,
                )
            )
        else:
            cached = out.scheduled_cached_reqs
            cached.req_ids.append(req.key)
            sent = req.num_runner_blocks
            cached.new_block_ids.append(blocks[sent:] if len(blocks) > sent else None)
            cached.num_computed_tokens.append(start)
            cached.block_offsets.append(sent)
        req.num_runner_blocks = len(blocks)
        reqs.append(req)
        out.num_scheduled_tokens.append(num_new)
        out.samples.append(samples)
        out.num_batched_tokens += num_new
        req.num_computed_tokens = start + num_new
        if samples:
            req.num_pending += 1
        if start < req.num_prompt_tokens <= req.num_computed_tokens and req.num_output_tokens == 0:
            self.prompt_tokens_total += req.num_prompt_tokens
        # Full blocks of known tokens enter the cache now: a later reader runs after this step
        # on the device (and within a step, every layer writes its K/V before attending).
        known = min(req.num_computed_tokens, req.num_tokens)
        self.kv.cache_blocks(req.key, req.all_token_ids, known, req.cache_salt, req.num_prompt_tokens)

    def _schedule_waiting(self, out: SchedulerOutput, reqs: list[Request], budget: int) -> None:
        bs = self.block_size
        prefilling = [r for r in self.running if not r.prefill_done]
        admitted: set[int] = set()
        for req in order_waiting(self.waiting, self.kv, self.config):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            parent = req.parent
            if parent is not None and not parent.status.finished and not parent.prefill_done:
                # n > 1: share the sibling's prefill once it is done
                continue
            if req.num_pending:  # preempted while its last step runs: wait for its token
                continue
            if not self._grammar_ready(req):  # compiling off the loop: others go ahead
                continue
            if req.params.prompt_logprobs is None and not self.whole_prompt:
                blocks, node = self.kv.match_prefix(req.all_token_ids, req.cache_salt)
            else:  # every prompt position computed here: its logprobs (or pooled rows) come
                # from the forward
                blocks, node = [], None
            if self.kv.tree is None and parent is not None and self.kv.has(parent.key):
                blocks = self.kv.shareable_prefix(parent.key, (req.num_prompt_tokens - 1) // bs)
            m = len(blocks)
            if self.kv.tree is not None and _shares_uncached_block(req, m, bs, prefilling):
                # another request is computing this prefix right now
                continue
            num_computed = m * bs
            if self.unchunked and req.num_tokens - num_computed > budget:
                break  # whole, in a later step (first come, first served)
            num_new = min(req.num_tokens - num_computed, budget)
            hit = self.kv.admit(req.key, blocks, node)
            if not self.kv.allocate_slots(req.key, num_computed + num_new):
                self.kv.free(req.key)
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
                req.first_scheduled_time = time.time()
                self.kv.record_query(req.num_prompt_tokens, hit)
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.add(id(req))
            self._commit(out, reqs, req, num_new, new=True)
            if not req.prefill_done:
                prefilling.append(req)
            budget -= num_new
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
            if any(r.priority for r in self.running):
                # Lower values first, so a step serves them first and preemption (from the
                # end) takes the highest value, newest first; all 0: admission order.
                self.running.sort(key=lambda r: (r.priority, r.arrival_time))

    # -- results ------------------------------------------------------------------------------

    def update(
        self,
        out: SchedulerOutput,
        sampled: list[int],
        logprobs: list[Logprobs | None] | None = None,
        num_tokens: list[int] | None = None,
    ) -> list[EngineCoreOutput]:
        """Append one step's sampled tokens and apply stops: ``num_tokens[i]`` tokens (default
        one) for the i-th ``out.samples`` entry that samples, in order in ``sampled``; a verify
        step's row has 1 to k + 1 (its agreeing guesses and one token of the target's).

        A request that finished or was aborted since the step was scheduled drops its tokens."""
        results: list[EngineCoreOutput] = []
        k = row = 0
        reqs = self._steps.pop(out.step_id, [])
        advanced = advance_matchers(self.structured, reqs, out, sampled, num_tokens)
        for req, samples in zip(reqs, out.samples, strict=True):
            if not samples:
                continue  # a prefill chunk: nothing sampled
            c = num_tokens[row] if num_tokens is not None else 1
            row += 1
            toks = sampled[k : k + c]
            lps = logprobs[k : k + c] if logprobs is not None else [None] * c
            k += c
            req.num_pending -= 1
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if drafts:
                self.spec_stats.record(len(drafts), c - 1)
                if req.status == RequestStatus.RUNNING:  # roll back over the rejected guesses
                    req.num_computed_tokens -= len(drafts) - (c - 1)
            if req.status.finished:
                continue
            first = req.num_output_tokens == 0
            new: list[int] = []
            finish = None
            for tok in toks:
                req.append_token(tok)
                new.append(tok)
                if req.matcher is not None and id(req) not in advanced:
                    if not req.matcher.accept_token(tok):
                        logger.warning("request %s: token %d rejected by its grammar", req.key, tok)
                if req.pooled is None:  # an embedding's one token is not generated text
                    self.generation_tokens_total += 1
                finish = self._check_stop(req, tok)
                if finish is not None:
                    break
            kept = [lp for lp in lps[: len(new)] if lp is not None]
            prompt_lps = req.prompt_logprobs if first else None
            if prompt_lps is not None and len(prompt_lps) != req.num_prompt_tokens - 1:
                prompt_lps = None  # an n > 1 sibling that shared the prompt's blocks
            results.append(
                EngineCoreOutput(
                    req.request_id, req.index, new, kept if kept else None,
                    finish_reason=finish, stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    first_scheduled_time=req.first_scheduled_time if first else None,
                    prompt_logprobs=prompt_lps,
                    pooled=req.pooled,
                )
            )
            req.pooled = None
            if first:
                req.prompt_logprobs = None
            if finish is not None:
                self._finish(req)
            elif drafts and req.status == RequestStatus.RUNNING:
                kept_blocks = self.kv.truncate(req.key, req.num_computed_tokens)
                req.num_runner_blocks = min(req.num_runner_blocks, kept_blocks)
        return results

    def add_prompt_logprobs(self, found: list[tuple[str, int, list[Logprobs]]]) -> None:
        """Merge a step's prompt logprobs (``worker/prompt_logprobs.py``) into their requests:
        each entry starts at a prompt position; a chunk computed again after a preemption adds
        only what is not there yet."""
        for key, start, lps in found:
            rid, _, index = key.rpartition("#")
            for req in self.requests.get(rid, []):
                have = req.prompt_logprobs
                if req.index == int(index) and have is not None and start <= len(have):
                    have.extend(lps[len(have) - start :])

    def add_pooled(self, found: list[tuple[str, bytes]]) -> None:
        """A step's pooled prompts (``worker/pooler.py``), for the outputs of their requests."""
        for key, vec in found:
            rid, _, index = key.rpartition("#")
            for req in self.requests.get(rid, []):
                if req.index == int(index):
                    req.pooled = vec

    def take_aborted(self) -> list[EngineCoreOutput]:
        """One ``abort`` output per sequence aborted since the last call."""
        results = [EngineCoreOutput(r.request_id, r.index, [], finish_reason="abort") for r in self._aborted]
        self._aborted.clear()
        return results

    def _check_stop(self, req: Request, tok: int) -> str | None:
        sp = req.params
        if tok in req.stop_ids and req.num_output_tokens > sp.min_tokens:
            req.stop_reason = tok
            req.status = RequestStatus.FINISHED_STOPPED
            return "stop"
        if req.matcher is not None and req.matcher.is_terminated():  # e.g. EOS with ignore_eos
            req.stop_reason = tok
            req.status = RequestStatus.FINISHED_STOPPED
            return "stop"
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return "length"
        return None

    def _finish(self, req: Request) -> None:
        try:
            self.running.remove(req)
        except ValueError:  # preempted while its last step ran
            self.waiting.remove(req)
        self.kv.free(req.key)
        self._finished_keys.append(req.key)
        self._on_finished(req)
        self._drop_if_done(req.request_id)

    def _on_finished(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.on_finished(req.key, req.all_token_ids, req.num_prompt_tokens)

    def _drop_if_done(self, request_id: str) -> None:
        if all(s.status.finished for s in self.requests.get(request_id, [])):
            self.requests.pop(request_id, None)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks_total=self.kv.num_blocks,
            num_blocks_free=self.kv.num_available,
            num_preemptions_total=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prefix_cache_host_hits=self.kv.host.hit_tokens if self.kv.host is not None else 0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos),
        )


def _shares_uncached_block(req: Request, m: int, bs: int, prefilling: list[Request]) -> bool:
    """Whether a request now prefilling will compute ``req``'s next uncached full prompt block."""
    end = (m + 1) * bs
    if end > req.num_prompt_tokens - 1:
        return False
    head = req.all_token_ids[:end]
    for other in prefilling:
        if (
            other.cache_salt == req.cache_salt
            and other.num_prompt_tokens > end
            and other.num_computed_tokens < end
            and other.all_token_ids[:end] == head
        ):
            return True
    return False
