"""A daemon registers the address clients reach it at, never a wildcard; the masters refuse a
wildcard or an address another live node holds; a client that knows which node it dials checks
the daemon that answers is that node.

Found by a deployment probe: two hosts, daemons "a" and "b" both with ``listen = 0.0.0.0:7400``
(the docs allow it). Both registered "0.0.0.0:7400"; a client on host B dialled 0.0.0.0:7400 for
node "a", reached B's own daemon, and was served (the client never checked the node id in the
HELLO reply, and the daemon's owner check runs only when epochs differ): host 2 overwrote 40 keys
(acknowledged), host 1 read the older values back for all 40."""

from __future__ import annotations

import sys

import pytest

from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.meta.master import register_error
from gcache.meta.master_client import MasterClient
from gcache.meta.nodetable import COMMAND_VERSION, NodeTable
from gcache.net.address import advertised_address_error, is_wildcard, parse_advertise
from tests.conftest import poll

GCACHE = [sys.executable, "-m", "gcache"]


# -- the address rule ---------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "0", "0.0", "::0", "0:0:0:0:0:0:0:0", "[::]", "*"])
def test_wildcard_hosts_are_recognised(host):
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.11", "::1", "[::1]", "gpu-a", "localhost", "0.0.0.1",
                                  "0host"])
def test_routable_hosts_are_not_wildcards(host):
    assert not is_wildcard(host)


@pytest.mark.parametrize("address", ["0.0.0.0:7400", "[::]:7400", "0:7400", "[0:0:0:0:0:0:0:0]:1"])
def test_a_wildcard_is_not_an_address_to_advertise_or_register(address):
    err = advertised_address_error(address)
    assert err is not None and "wildcard" in err and "--advertise" in err
    reg = register_error({"node": "n1", "address": address, "capacity": 1 << 30})
    assert reg is not None and "'address'" in reg and "wildcard" in reg


def test_routable_addresses_pass_the_rule():
    for a in ("127.0.0.1:7400", "10.0.0.11:7400", "[::1]:7400", "gpu-a:7400"):
        assert advertised_address_error(a) is None


@pytest.mark.parametrize(("text", "port", "want"), [
    ("10.0.0.11", 7400, "10.0.0.11:7400"), ("10.0.0.11:7500", 7400, "10.0.0.11:7500"),
    ("gpu-a", 41234, "gpu-a:41234"), ("[fd00::1]:7401", 7400, "[fd00::1]:7401"),
    ("fd00::1", 7400, "[fd00::1]:7400"), ("[fd00::1]", 7400, "[fd00::1]:7400")])
def test_advertise_is_host_or_host_port_the_port_defaulting_to_the_bound_one(text, port, want):
    assert parse_advertise(text, port) == want


@pytest.mark.parametrize("text", ["", "h:0", "h:70000", "a b", "0.0.0.0", "[::]:7400", "h:x:1:"])
def test_a_bad_advertise_is_refused(text):
    with pytest.raises(ValueError):
        parse_advertise(text, 7400)


# -- the masters --------------------------------------------------------------------------------
def _register(table: NodeTable, node: str, address: str) -> None:
    table.apply({"v": COMMAND_VERSION, "op": "register", "node": node, "address": address, "capacity": 1 << 30})


def test_the_table_names_the_live_node_that_holds_an_address():
    t = NodeTable()
    _register(t, "a", "10.0.0.11:7400")
    assert t.address_holder("10.0.0.11:7400", "b") == "a"
    assert t.address_holder("10.0.0.11:7400", "a") is None  # its own address: a restart
    assert t.address_holder("10.0.0.12:7400", "b") is None
    t.apply({"v": COMMAND_VERSION, "op": "set_state", "node": "a", "inc": 1, "state": "suspect"})
    assert t.address_holder("10.0.0.11:7400", "b") == "a"
    t.apply({"v": COMMAND_VERSION, "op": "set_state", "node": "a", "inc": 1, "state": "down"})
    assert t.address_holder("10.0.0.11:7400", "b") is None


def test_masters_refuse_a_wildcard_and_an_address_another_live_node_holds(tmp_path):
    with LocalCluster(nodes=0, masters=1, root=str(tmp_path),
                      master_args=["--suspect-after", "1", "--down-after", "2"]) as cl:
        mc = MasterClient(cl.master_url, cl.token, timeout_s=5.0)
        try:
            with pytest.raises(GCacheError, match="wildcard"):
                mc.call("Register", {"node": "w", "address": "0.0.0.0:7400", "capacity": 1 << 30})
            mc.call("Register", {"node": "a", "address": "127.0.0.1:7400", "capacity": 1 << 30})
            with pytest.raises(GCacheError, match="'a'") as err:
                mc.call("Register", {"node": "b", "address": "127.0.0.1:7400", "capacity": 1 << 30})
            assert "127.0.0.1:7400" in str(err.value)
            # the same node again (a restart) is welcome
            mc.call("Register", {"node": "a", "address": "127.0.0.1:7400", "capacity": 1 << 30})
            ids = [r["id"] for r in mc.membership()["nodes"]]
            assert ids == ["a"]
            # "a" sends no heartbeats: once it is down, another node may take its address
            poll(lambda: any(r["id"] == "a" and r["state"] == "down" for r in mc.membership()["nodes"]), 20)
            mc.call("Register", {"node": "b", "address": "127.0.0.1:7400", "capacity": 1 << 30})
        finally:
            mc.close()
