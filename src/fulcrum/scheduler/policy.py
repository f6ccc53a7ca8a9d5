"""Order of the waiting queue: ``fcfs`` (priority, lower first, then preempted requests, then
arrival) or ``lpm`` (longest cached prefix first, so requests that share a prefix run while it
is hot; FCFS past a queue length)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fulcrum.config import SchedulerConfig
from fulcrum.kv_cache.manager import KVCacheManager
from fulcrum.request import Request


def order_waiting(
    waiting: Sequence[Request], kv: KVCacheManager, config: SchedulerConfig
) -> Iterable[Request]:
    if config.schedule_policy == "lpm" and kv.tree is not None and len(waiting) <= config.lpm_max_queue:
        # Preempted requests keep their place at the front; the rest by cached prefix length.
        head = [r for r in waiting if r.num_preemptions]
        rest = [r for r in waiting if not r.num_preemptions]
        match = {id(r): kv.cached_prefix_blocks(r.all_token_ids, r.cache_salt) for r in rest}
        rest.sort(key=lambda r: (-match[id(r)], r.priority, r.arrival_time))
        return head + rest
    if any(r.priority for r in waiting):
        return sorted(waiting, key=lambda r: (r.priority, -bool(r.num_preemptions), r.arrival_time))
    return list(waiting)
