"""What the ingress sends a replica: one HTTP request, already read, plus the text the request
router matches against its prefix trees (computed once, at the ingress)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProxiedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    route_text: str = ""  # the prompt text, approximately (router.shape.prompt_text)
    replica: str = ""  # this replica only (its unique id): the ingress's per-replica /metrics


@dataclass
class ResponseHead:
    """The first item a replica yields; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str  # the replica's id, returned to clients as x-fulcrum-replica
