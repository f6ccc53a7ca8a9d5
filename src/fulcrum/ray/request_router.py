"""A cache-aware Ray Serve request router: the ``fulcrum router``'s ``cache_aware`` rule, over the
replicas of one deployment.

Ray Serve asks :meth:`choose_replicas` for ranked candidate lists and then sends the request to the
least queued replica of the first rank that has room. The first rank here is the one replica the
cache-aware rule picks (longest matched prefix while loads are balanced; the least loaded past
the imbalance thresholds; the smallest tree when nothing matches well); the second rank holds the
others, so a full replica never blocks a request. Each replica has an approximate prefix tree
(:class:`fulcrum.router.prefix_tree.PrefixTree`) of the prompts routed to it, filled when Serve
reports a request routed, and dropped with the replica.

The router runs in the process holding the deployment's handle (the ingress replica); its load
is the requests it has in flight on each replica, or Serve's cached queue length when larger
(requests from other ingress replicas)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fulcrum.ray.config import RayServeConfig
from fulcrum.router.policies import cache_aware_pick
from fulcrum.router.prefix_tree import PrefixTree, block_hashes
from fulcrum.router.shape import prompt_text


def pinned_replica(pending: PendingRequest | None) -> str:
    """The replica a ProxiedRequest names (``replica``), or ""."""
    if pending is None:
        return ""
    for arg in [*pending.args, *pending.kwargs.values()]:
        rid = getattr(arg, "replica", None)
        if isinstance(rid, str):
            return rid
    return ""


def routing_text(pending: PendingRequest | None) -> str | None:
    """The prompt text of a request: a ProxiedRequest's ``route_text``, or an OpenAI body."""
    if pending is None:
        return None
    for arg in [*pending.args, *pending.kwargs.values()]:
        text = getattr(arg, "route_text", None)
        if isinstance(text, str):
            return text
        if isinstance(arg, Mapping):
            return prompt_text(arg)
    return None


# The live replicas' unique ids, as this process's router last saw them: the ingress asks each
# one for its /metrics. One engine deployment per application, so one list.
LIVE_REPLICAS: list[str] = []


def _publish(ids: list[str]) -> None:
    # Through the module itself: Serve may run a by-value copy of the router class (and of this
    # function), whose globals are not this module's.
    import fulcrum.ray.request_router as home

    home.LIVE_REPLICAS = sorted(ids)


class CacheAwareRequestRouter(RequestRouter):
    def initialize_state(
        self,
        cache_threshold: float = RayServeConfig.cache_threshold,
        balance_abs_threshold: int = RayServeConfig.balance_abs_threshold,
        balance_rel_threshold: float = RayServeConfig.balance_rel_threshold,
        block_chars: int = RayServeConfig.cache_block_chars,
        max_chars: int = RayServeConfig.cache_max_chars,
        **_: Any,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.block_chars = block_chars
        self.max_chars = max_chars
        self.trees: dict[ReplicaID, PrefixTree] = {}
        self.in_flight: dict[ReplicaID, int] = {}
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> its replica
        self.prompt_chars = 0  # routed prompt text, and how much of it the trees matched
        self.matched_chars = 0

    @property
    def hit_rate(self) -> float:
        """Estimated share of routed prompt text found in the chosen replica's cache."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    def _tree(self, rid: ReplicaID) -> PrefixTree:
        tree = self.trees.get(rid)
        if tree is None:
            tree = self.trees[rid] = PrefixTree(self.block_chars, self.max_chars)
        return tree

    def load(self, rid: ReplicaID) -> int:
        queued = self._replica_queue_len_cache.get(rid)
        return max(self.in_flight.get(rid, 0), queued or 0)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every replica full: Serve retries this call; back off between tries.
            pending_request.routing_context.should_backoff = True
        pinned = pinned_replica(pending_request)
        if pinned:
            # A request for one replica (its metrics): that one, or, if it is gone, any (the
            # ingress sees the answering replica's id and drops the answer).
            match = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [match or list(candidate_replicas)]
        text = routing_text(pending_request)
        if text is None or len(candidate_replicas) < 2:
            return [list(candidate_replicas)]  # Serve takes the least queued
        hashes = block_hashes(text, self.block_chars)
        ids = [r.replica_id for r in candidate_replicas]
        i = cache_aware_pick(
            [self.load(rid) for rid in ids],
            [self._tree(rid).match(hashes) for rid in ids],
            [self._tree(rid).size_chars for rid in ids],
            len(text),
            cache_threshold=self.cache_threshold,
            balance_abs=self.balance_abs,
            balance_rel=self.balance_rel,
        )
        chosen = candidate_replicas[i]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        text = routing_text(pending_request)
        if text:
            hashes = block_hashes(text, self.block_chars)
            tree = self._tree(replica_id)
            self.prompt_chars += len(text)
            self.matched_chars += tree.match(hashes)
            tree.insert(hashes)
        req_id = pending_request.metadata.internal_request_id
        if req_id not in self._routed:
            self._routed[req_id] = replica_id
            self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, None)
        if rid is not None and rid in self.in_flight:
            self.in_flight[rid] = max(0, self.in_flight[rid] - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _publish([r.replica_id.unique_id for r in replicas])
        for rid in set(self.trees) | set(self.in_flight):
            if rid not in self._replica_id_set:
                self._forget(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, rid: ReplicaID) -> None:
        import fulcrum.ray.request_router as home

        _publish([i for i in home.LIVE_REPLICAS if i != rid.unique_id])
        self.trees.pop(rid, None)
        self.in_flight.pop(rid, None)
