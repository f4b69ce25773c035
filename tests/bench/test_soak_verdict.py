"""The soak's judge (gcache.bench.soak.KeyStates.verdict): what a read may return for a key."""

from gcache.bench.soak import DEL, PUT, KeyStates


def test_a_write_with_an_unknown_outcome_may_appear_only_until_a_later_one_is_acknowledged():
    st = KeyStates(1)
    st.unknown[0].add(3)  # write 3 timed out: it may have landed
    assert st.verdict(0, 3, (2, PUT)) is None  # nothing newer acknowledged: fine
    assert st.verdict(0, 3, (4, PUT)) == "stale"  # write 4 (issued after 3 was given up) was acknowledged
    assert st.verdict(0, 3, (4, DEL)) == "resurrected"


def test_the_last_acknowledged_write_and_anything_newer_may_be_read():
    st = KeyStates(1)
    assert st.verdict(0, 5, (5, PUT)) is None
    assert st.verdict(0, 6, (5, PUT)) is None  # in flight when the read was sent
    assert st.verdict(0, 6, (5, DEL)) is None
    assert st.verdict(0, 5, (5, DEL)) == "resurrected"
    assert st.verdict(0, 4, (5, PUT)) == "stale"
