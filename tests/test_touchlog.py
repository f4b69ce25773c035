"""gcache.server.touchlog: a handover's pushed copy never undoes a client's write or delete."""

from gcache.server.touchlog import TouchLog

K = ("ns", b"k")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_pushed_copy_is_stored_only_where_no_client_got_there_first():
    log = TouchLog()
    stored = []
    assert log.admit(K, lambda k: False, lambda: stored.append(K))  # untouched, absent: stored
    assert not log.admit(K, lambda k: True, lambda: stored.append(K))  # present: never overwritten
    log.touch(("ns", b"deleted"))  # a client deleted it here: absent, but must not come back
    assert not log.admit(("ns", b"deleted"), lambda k: False, lambda: stored.append("x"))
    assert stored == [K] and log.refused == 2
    assert log.touched(("ns", b"deleted")) and not log.touched(K)


def test_entries_outlive_their_ttl_while_a_handover_is_open():
    clock = Clock()
    log = TouchLog(ttl_s=30, clock=clock)
    log.touch(K)
    log.set_handover_open(True)
    clock.t += 100
    log.touch(("ns", b"other"))  # pruning runs on every touch
    assert log.touched(K)  # the handover is still open: a push of K may still come
    log.set_handover_open(False)
    assert not log.touched(K) and log.touched(("ns", b"other"))


def test_overflow_refuses_every_push_until_the_handover_closes_and_ttl_passes():
    clock = Clock()
    log = TouchLog(ttl_s=30, cap=3, clock=clock)
    log.set_handover_open(True)
    for i in range(4):
        log.touch(("ns", bytes([i])))
    assert len(log) == 0  # forgotten...
    assert log.touched(("ns", b"never")) and not log.admit(("ns", b"x"), lambda k: False, lambda: None)
    clock.t += 100
    assert log.touched(("ns", b"never"))  # ...and vouching for nothing while the handover is open
    log.set_handover_open(False)
    assert not log.touched(("ns", b"never"))


def test_clear_after_a_drop():
    log = TouchLog()
    log.touch(K)
    log.clear()
    assert not log.touched(K) and log.admit(K, lambda k: False, lambda: None)


def test_a_distrusted_log_refuses_pushes_until_the_handover_closes_and_ttl_passes():
    """A daemon restarted while its incarnation stayed up lost the log of what clients did here."""
    clock = Clock()
    log = TouchLog(ttl_s=30, clock=clock)
    log.distrust()
    log.set_handover_open(True)
    clock.t += 100
    assert not log.admit(K, lambda k: False, lambda: None) and log.touched(K)
    log.set_handover_open(False)
    assert log.admit(K, lambda k: False, lambda: None) and not log.touched(("ns", b"other"))


def test_a_cleared_namespace_refuses_pushes_and_makes_misses_final_for_ttl():
    clock = Clock()
    log = TouchLog(ttl_s=30, clock=clock)
    log.touch_namespace("ns")
    assert log.touched(K) and not log.admit(K, lambda k: False, lambda: None)
    assert not log.touched(("other", b"k")) and log.admit(("other", b"k"), lambda k: False, lambda: None)
    clock.t += 100
    log.touch(("other", b"x"))  # pruning runs on every touch
    assert not log.touched(K) and log.admit(K, lambda k: False, lambda: None)


def test_cleared_namespaces_are_bounded_like_keys():
    """A probe cleared 16,000 namespaces during a handover: the map of cleared namespaces grew
    without bound (pruning skips while a handover is open), and every touch rebuilt a list of
    all of it (a put 2.7x slower). Past ``cap`` it overflows like the key log: nothing vouched
    for until it has been empty for ttl_s."""
    clock = Clock()
    log = TouchLog(ttl_s=30, cap=3, clock=clock)
    log.set_handover_open(True)
    for i in range(3):
        log.touch_namespace(f"ns{i}")
    assert not log.touched(("elsewhere", b"k"))
    log.touch_namespace("ns3")  # one past the cap
    assert log.touched(("elsewhere", b"k")) and not log.admit(("elsewhere", b"k"), lambda k: False, lambda: None)
    log.set_handover_open(False)
    clock.t += 31
    assert not log.touched(("elsewhere", b"k"))
