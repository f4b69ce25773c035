"""The wait queue: exact orders, expiry, cancellation, and starvation-freedom of AGED."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import QueueConfig, QueueOrder
from router.queue import PendingQueue


def drain(q):
    out = []
    while len(q):
        out.append(q.pop())
    return out


def fill(order, items, aging=10.0, max_wait=1000.0):
    q = PendingQueue(QueueConfig(order=order, aging_tokens_per_s=aging, max_wait_s=max_wait))
    for name, unc, t in items:
        q.push(name, unc, t)
    return q


ITEMS = [("a", 1000, 0.0), ("b", 10, 1.0), ("c", 500, 2.0), ("d", 10, 3.0)]


def test_orders():
    assert drain(fill(QueueOrder.FCFS, ITEMS)) == ["a", "b", "c", "d"]
    assert drain(fill(QueueOrder.UNCACHED, ITEMS)) == ["b", "d", "c", "a"]
    # aged keys: a 1000, b 20, c 520, d 40
    assert drain(fill(QueueOrder.AGED, ITEMS)) == ["b", "d", "c", "a"]
    # with fast aging the old request wins: a 1000, b 1010, c 2500, d 3010
    assert drain(fill(QueueOrder.AGED, ITEMS, aging=1000.0)) == ["a", "b", "c", "d"]
    # uncached tokens count up to aging x max_wait / 2 (500 here): a 500, b 20, c 520, d 40
    assert drain(fill(QueueOrder.AGED, ITEMS, max_wait=100.0)) == ["b", "d", "a", "c"]


def test_expire_and_cancel():
    q = PendingQueue(QueueConfig(order=QueueOrder.UNCACHED, max_wait_s=5, max_depth=3))
    h = q.push("x", 1, 0.0)
    q.push("y", 2, 1.0)
    q.push("z", 3, 4.0)
    assert q.full()
    assert q.cancel(h) and not q.cancel(h) and len(q) == 2
    assert q.expire(5.5) == [] and q.expire(6.5) == ["y"]
    assert q.peek() == "z" and q.pop() == "z" and len(q) == 0
    assert q.oldest_arrival() is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 100_000), st.floats(0, 5)), min_size=1, max_size=60),
    st.floats(100, 50_000),
    st.integers(1, 3),
    st.sampled_from([1e9, 10.0, 1.0]),
)
def test_aged_order_is_starvation_free(arrivals, aging, serve_every, max_wait):
    """Requests arrive (uncached tokens, gap); the server pops one per ``serve_every``
    arrivals. No request is ever overtaken by one that arrived more than
    min(uncached / aging, max_wait / 2) seconds after it, so its wait is bounded whatever
    arrives later, and within max_wait however many tokens it has."""
    q = PendingQueue(QueueConfig(order=QueueOrder.AGED, aging_tokens_per_s=aging, max_wait_s=max_wait))
    t, served, info = 0.0, [], {}
    for i, (unc, gap) in enumerate(arrivals):
        t += gap
        info[i] = (unc, t)
        q.push(i, unc, t)
        if i % serve_every == 0:
            served.append(q.pop())
    served += drain(q)
    assert sorted(served) == list(range(len(arrivals)))
    pos = {r: k for k, r in enumerate(served)}
    for r, (unc, t_r) in info.items():
        for s, (_, t_s) in info.items():
            if t_s > t_r + min(unc / aging, max_wait / 2) + 1e-9:
                assert pos[r] < pos[s], f"request {r} starved behind later request {s}"
