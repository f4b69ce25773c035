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


def test_a_run_that_checked_nothing_is_not_a_pass_and_its_length_must_be_finite():
    """A probe: --minutes nan ran nothing and printed "OK: nothing wrong"; inf crashed, then hung."""
    import math

    import pytest

    from gcache.bench.soak import SoakConfig, SoakReport

    assert not SoakReport().ok  # no operation, no acknowledged put
    assert SoakReport(ops=10, puts_acked=3).ok
    assert not SoakReport(ops=10, puts_acked=3, stale=1).ok
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="finite run length"):
            SoakConfig(seconds=bad)
