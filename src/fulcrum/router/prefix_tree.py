"""An approximate radix tree of the prompts routed to one worker (what its prefix cache likely holds).

The tree is kept in hashed form, as the engine's prefix cache keys its blocks: a prompt is cut into
blocks of ``block_chars`` characters and each block's node is named by a hash chained from its
parent's, so one node names a whole path from the root::

    "You are a helpful assistant. Answer briefly. What is 2+2?"
     |--- block 0 ---|--- block 1 ---|--- block 2 ---|   (tail shorter than a block: not kept)
     h0 = H(b0)       h1 = H(h0, b1)  h2 = H(h1, b2)

A lookup walks the chain until the first missing node. Nodes are kept in least-recently-used
order; a lookup or insert touches a path deepest node first, so a parent is always at least as
recent as its children and eviction removes leaves before the nodes above them. It is
approximate: the worker's real cache may have evicted sooner (or kept longer) than this tree.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """The chained hash of each full block of ``text``."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hashlib.blake2b(
            text[start : start + block_chars].encode(), digest_size=12, key=parent[:12]
        )
        parent = h.digest()
        out.append(parent)
    return out


class PrefixTree:
    def __init__(self, block_chars: int = 32, max_chars: int = 4_000_000) -> None:
        if block_chars < 1:
            raise ValueError("block_chars must be at least 1")
        self.block_chars = block_chars
        self.max_blocks = max(1, max_chars // block_chars)
        self._nodes: OrderedDict[bytes, None] = OrderedDict()

    @property
    def size_chars(self) -> int:
        return len(self._nodes) * self.block_chars

    def match(self, hashes: list[bytes]) -> int:
        """Characters of the longest cached prefix (a multiple of ``block_chars``)."""
        n = 0
        for h in hashes:
            if h not in self._nodes:
                break
            n += 1
        return n * self.block_chars

    def insert(self, hashes: list[bytes]) -> None:
        """Add (or refresh) the path; evict least recently used nodes past ``max_chars``."""
        for h in reversed(hashes):
            self._nodes[h] = None
            self._nodes.move_to_end(h)
        while len(self._nodes) > self.max_blocks:
            self._nodes.popitem(last=False)

    def clear(self) -> None:
        self._nodes.clear()
