"""Bad Register / HandoverDone requests are refused with a reason and change nothing.

Found by a probe: a Register with the address "not-an-address" was accepted, went into the
membership, and every client and daemon failed on it (a membership they could not route by)."""

import pytest

from gcache import Client
from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.meta.master import MAX_CAPACITY, register_error
from gcache.meta.master_client import MasterClient

GOOD = {"node": "n1", "address": "127.0.0.1:7000", "capacity": 1 << 30}


@pytest.mark.parametrize("field, value", [
    ("node", ""), ("node", 7), ("node", "x" * 256), ("address", "not-an-address"), ("address", "h:0"),
    ("address", "h:70000"), ("address", 5), ("capacity", 0), ("capacity", -1), ("capacity", 1e30),
    ("capacity", MAX_CAPACITY + 1), ("capacity", "1"), ("capacity", True)])
def test_register_requests_are_checked_field_by_field(field, value):
    assert register_error(GOOD) is None
    err = register_error({**GOOD, field: value})
    assert err is not None and f"'{field}'" in err


def test_a_master_refuses_a_malformed_registration_and_keeps_serving(tmp_path):
    with LocalCluster(nodes=1, masters=1, mem="32MiB", root=str(tmp_path / "c")) as cl:
        mc = MasterClient(cl.master_url, cl.token, timeout_s=5.0)
        for bad in ({**GOOD, "address": "not-an-address"}, {**GOOD, "capacity": 1e30}, {"node": "n2"}):
            with pytest.raises(GCacheError, match="Register: '"):
                mc.call("Register", bad)
        with pytest.raises(GCacheError, match="HandoverDone needs"):
            mc.call("HandoverDone", {"node": "node0", "epoch": 1e300})
        with Client(cl.master_url, token=cl.token, timeout_s=5.0) as c:
            assert [n for n in c.membership.owners()] == ["node0"]
            assert c.put([b"k"], [b"v"])[0].name == "OK" and c.get([b"k"]) == [b"v"]
