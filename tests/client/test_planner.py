"""The fan-out planner alone: pure functions, no sockets."""

from gcache.client.planner import Request, by_owner, misses, plan, split, to_fall_back, to_retry
from gcache.protocol import Status


def test_by_owner_keeps_batch_order_per_owner():
    assert by_owner([0, 1, 2, 3, 4], ["a", "b", "a", "c", "b"]) == {"a": [0, 2], "b": [1, 4], "c": [3]}
    assert by_owner([], []) == {}


def test_by_owner_over_a_subset_of_positions():
    assert by_owner([3, 7, 9], ["x", "x", "y"]) == {"x": [3, 7], "y": [9]}


def test_split_by_key_count_without_sizes():
    assert split(list(range(5)), None, 1 << 20, 2) == [[0, 1], [2, 3], [4]]
    assert split([4, 9], None, 1 << 20, 64) == [[4, 9]]


def test_split_by_bytes_when_sizes_are_known():
    sizes = [3, 3, 3, 10, 1]
    # at most 6 bytes per request; a value larger than the limit still goes, alone
    assert split([0, 1, 2, 3, 4], sizes, 6, 64) == [[0, 1], [2], [3], [4]]
    # sizes decide, not the key count...
    assert split([0, 1, 2], sizes, 100, 1) == [[0, 1, 2]]


def test_a_put_of_many_tiny_values_is_cut_into_requests_the_daemon_takes():
    """...up to SIZED_SPLIT_KEYS keys a request: 65,537 one-byte values went out as one request,
    refused whole (more than MAX_BATCH_KEYS items; 17,000 keys of 1,000 bytes: metadata over 16 MiB,
    the connection reset), a prober."""
    from gcache.client.planner import SIZED_SPLIT_KEYS

    n = 65_537
    chunks = split(list(range(n)), [1] * n, 4 << 20, 64)
    assert [len(c) for c in chunks] == [SIZED_SPLIT_KEYS] * (n // SIZED_SPLIT_KEYS) + [n % SIZED_SPLIT_KEYS]
    assert [i for c in chunks for i in c] == list(range(n))


def test_plan_one_request_per_owner_and_chunk():
    reqs = plan([0, 1, 2, 3], ["a", "b", "a", "a"], None, 1 << 20, 2)
    assert reqs == [Request("a", [0, 2]), Request("a", [3]), Request("b", [1])]


def test_plan_splits_local_path_owners_by_key_count_only():
    sizes = [4, 4, 4, 4]
    reqs = plan([0, 1, 2, 3], ["a", "b", "a", "b"], sizes, 4, 64, by_keys_only=lambda node: node == "a")
    assert reqs == [Request("a", [0, 2]), Request("b", [1]), Request("b", [3])]


def test_retry_only_not_owner():
    st = [Status.OK, Status.NOT_OWNER, Status.NOT_FOUND, Status.NOT_OWNER, Status.UNAVAILABLE]
    assert to_retry(st) == [1, 3]


def test_misses_skip_final_ones():
    st = [Status.NOT_FOUND, Status.OK, Status.NOT_FOUND, Status.NOT_FOUND]
    assert misses(st, final={2}) == [0, 3]


def test_fall_back_only_where_the_owner_changed_and_the_old_one_is_reachable():
    which = [0, 3, 5, 6]
    now = ["a", "b", "c", "d"]
    before = ["a", "x", "y", "z"]  # 0: same owner; 3: moved from x; 5: from y (gone); 6: from z
    assert to_fall_back(which, now, before, {"x": "h:1", "z": "h:2"}) == [3, 6]
