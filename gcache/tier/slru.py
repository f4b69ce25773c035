"""The ``slru`` eviction policy: a probation LRU for entries never referenced since they were
written, a main LRU for the others, ghost lists that send a recently evicted key straight to
main when it is written again, and a split between the two lists that adapts to the workload.

Why this shape (measured on the conversation trace, bench/RESULTS.md): three quarters of the
blocks of a prefix trace are never read again, and nothing the daemon sees when a block is
first written tells those apart from the ones that will be, so a new entry has to earn its
place. A probation list bounds how much of RAM first-time entries may take; an entry read
again (or written again soon after it was evicted, remembered by its hash in a ghost list)
moves to main, where an unbroken run of such entries (a conversation that went on, a shared
system prompt) stays while fresh blocks pass through probation.

The probation share (``probation``, 0.6 at start, in [``min_probation``, ``max_probation``])
follows the marginal value of each list: each list has a ghost list of the keys it evicted,
numbered in eviction order; a key written again among the last ``marginal`` x resident keys a
list evicted would have been a hit had that list been slightly larger, so the share moves
``adapt_step`` toward that list. Both windows have the same size, so the two counts compare
like for like (unlike ARC, whose ghost lists are as long as its lists). On the conversation
trace it ends near 0.55 at 5% of the working set and near 0.7 at 20%, where a long probation
window catches most first reuses. The step is small (0.0002) because each daemon adapts on its
own: larger steps let the daemons' splits drift apart, and a chain spread over them breaks at
the daemon with the shortest window.

O(1) per operation: two ordered dicts of keys, two ghost dicts of hashes, each bounded by
``ghost_factor`` x the resident keys (at least MIN_GHOST).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

from gcache.tier.eviction import MIN_GHOST, EvictionConfig, EvictionKind, EvictionPolicy


class SeqGhost:
    """Hashes of recently evicted keys with their eviction number, oldest first, at most
    ``factor`` x resident (>= MIN_GHOST). A hash collision only lets a new key start in main."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._h: OrderedDict[int, int] = OrderedDict()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._h)

    def add(self, key: Hashable, resident: int) -> None:
        if self.factor <= 0:
            return
        self._seq += 1
        self._h[hash(key)] = self._seq
        limit = max(int(resident * self.factor), MIN_GHOST)
        while len(self._h) > limit:
            self._h.popitem(last=False)

    def take(self, key: Hashable) -> int | None:
        """How many keys were evicted after ``key`` (0: it was the last), or None when it is not
        remembered; forgets it."""
        seq = self._h.pop(hash(key), None)
        return None if seq is None else self._seq - seq


class SlruPolicy(EvictionPolicy):
    kind = EvictionKind.SLRU

    def __init__(self, config: EvictionConfig, capacity: int) -> None:
        super().__init__(config, capacity)
        self._prob: OrderedDict[Hashable, int] = OrderedDict()  # key -> size
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._prob_bytes = self._main_bytes = 0
        self._prob_ghost = SeqGhost(config.ghost_factor)
        self._main_ghost = SeqGhost(config.ghost_factor)
        self.share = config.probation  # target share of the bytes for probation

    def __len__(self) -> int:
        return len(self._prob) + len(self._main)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._prob or key in self._main

    def __repr__(self) -> str:
        return (f"SlruPolicy(probation={len(self._prob)}, main={len(self._main)}, share={self.share:.3f}, "
                f"ghosts={len(self._prob_ghost)}+{len(self._main_ghost)})")

    def _marginal(self, age: int | None) -> bool:
        return age is not None and age < max(1, int(self.config.marginal * len(self)))

    def insert(self, key: Hashable, size: int, reused: bool = False) -> None:
        for queue in (self._prob, self._main):
            old = queue.get(key)
            if old is not None:  # an overwrite: a reference
                queue[key] = size
                if queue is self._prob:
                    self._prob_bytes += size - old
                else:
                    self._main_bytes += size - old
                self.hit(key)
                return
        cfg = self.config
        age = self._prob_ghost.take(key)
        if age is not None:
            if self._marginal(age):
                self.share = min(cfg.max_probation, self.share + cfg.adapt_step)
            reused = True
        else:
            age = self._main_ghost.take(key)
            if age is not None:
                if self._marginal(age):
                    self.share = max(cfg.min_probation, self.share - cfg.adapt_step)
                reused = True
        if reused:
            self._main[key] = size
            self._main_bytes += size
        else:
            self._prob[key] = size
            self._prob_bytes += size

    def hit(self, key: Hashable) -> None:
        if key in self._main:
            self._main.move_to_end(key)
            return
        size = self._prob.pop(key, None)
        if size is not None:
            self._prob_bytes -= size
            self._main[key] = size
            self._main_bytes += size

    def hit_many(self, keys: Iterable[Hashable]) -> None:
        """hit() of each key, in one loop."""
        main, prob = self._main, self._prob
        to_end, take = main.move_to_end, prob.pop
        for key in keys:
            if key in main:
                to_end(key)
                continue
            size = take(key, None)
            if size is not None:
                self._prob_bytes -= size
                main[key] = size
                self._main_bytes += size

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        size = self._prob.pop(key, None)
        if size is not None:
            self._prob_bytes -= size
            if evicted:
                self._prob_ghost.add(key, len(self))
            return
        size = self._main.pop(key, None)
        if size is not None:
            self._main_bytes -= size
            if evicted:
                self._main_ghost.add(key, len(self))

    def reused(self, key: Hashable) -> bool:
        return key in self._main

    def _pick(self) -> OrderedDict[Hashable, int]:
        prob, main = self._prob, self._main
        if not main:
            return prob
        if not prob:
            return main
        over = self._prob_bytes > self.share * (self._prob_bytes + self._main_bytes)
        return prob if over else main

    def candidates(self) -> Iterator[Hashable]:
        offered: set[Hashable] = set()  # keys left in place (in use) this call
        while len(self):
            queue = self._pick()
            key = next(iter(queue))
            if key in offered:  # every key of that list is in use: try the other one
                other = self._main if queue is self._prob else self._prob
                key = next(iter(other), key) if other else key
                if key in offered:
                    return
                queue = other
            offered.add(key)
            yield key
            if key in queue:  # in use: counts as just referenced, stays in its list
                queue.move_to_end(key)
