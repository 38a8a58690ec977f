"""Which replica already holds the start of a prompt: the router's picture of its replicas'
prefix caches, so a session's next turn goes where the previous turn's KV states are kept.

A conversation's next prompt is its previous prompt, the answer and the new message, so a
replica that served turn n holds (in its prefix cache) a prefix of turn n + 1's prompt. The
index remembers, for every finished sequence (prompt + response ids), a chain of hashes over
whole blocks of `block` tokens (each hash covers the block and every block before it) and which
replica it finished on; `match` walks a new prompt's chain and returns the replica of the
deepest block found and how many tokens that covers. No session ids are needed, and a shared
system prompt alone matches only its own few blocks (the router asks for a share of the
prompt before it follows affinity). Hash collisions cost a cache miss, never a wrong answer.

Entries are keyed by an opaque replica key (the router uses index and incarnation, so a
restarted replica's empty cache is never followed) and evicted least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class AffinityIndex:
    def __init__(self, block: int = 16, capacity: int = 200_000):
        self.block = block
        self.capacity = capacity
        self._owner: OrderedDict[int, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def _chain(self, ids: list[int]) -> Iterator[tuple[int, int]]:
        h = 0
        for end in range(self.block, len(ids) + 1, self.block):
            h = hash((h, tuple(ids[end - self.block : end])))
            yield end, h

    def remember(self, ids: list[int], replica: Hashable) -> None:
        # deepest first, so a sequence's first blocks are the most recently used and outlive
        # its later ones (match stops at the first missing block)
        for _, h in reversed(list(self._chain(ids))):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def match(self, ids: list[int]) -> tuple[Hashable | None, int]:
        """(the replica holding the longest cached prefix of `ids`, its length in tokens), or (None, 0)."""
        best: tuple[Hashable | None, int] = (None, 0)
        for end, h in self._chain(ids):
            owner = self._owner.get(h)
            if owner is None:
                break  # a chain: no deeper block can be there without this one
            best = (owner, end)
        return best
