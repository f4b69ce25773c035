"""A daemon registers the address clients reach it at, never a wildcard; the masters refuse a
wildcard or an address another live node holds; a client that knows which node it dials checks
the daemon that answers is that node.

Found by a deployment probe: two hosts, daemons "a" and "b" both with ``listen = 0.0.0.0:7400``
(the docs allow it). Both registered "0.0.0.0:7400"; a client on host B dialled 0.0.0.0:7400 for
node "a", reached B's own daemon, and was served (the client never checked the node id in the
HELLO reply, and the daemon's owner check runs only when epochs differ): host 2 overwrote 40 keys
(acknowledged), host 1 read the older values back for all 40."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from gcache import Client, ClientConfig, OnNodeError, Status
from gcache.client.config import LocalPath
from gcache.cluster import LocalCluster
from gcache.errors import ConnectionFailed, GCacheError
from gcache.meta.master import register_error
from gcache.meta.master_client import MasterClient
from gcache.meta.membership import Membership
from gcache.meta.nodetable import COMMAND_VERSION, NodeTable
from gcache.net.address import advertised_address_error, is_wildcard, parse_advertise
from gcache.transport import Transport, open_connection
from tests.conftest import poll
from tests.server.memory_daemon import memory_cluster

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


# -- the daemon ---------------------------------------------------------------------------------
def _daemon(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*GCACHE, "daemon", "--mem", "16MiB", "--no-pretouch", *argv], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_a_daemon_on_a_wildcard_without_advertise_refuses_to_start(listen):
    p = _daemon("--listen", listen)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "wildcard" in lines[0] and "set --advertise" in lines[0], lines[0]


def test_a_daemon_refuses_a_wildcard_advertise(tmp_path):
    p = _daemon("--listen", "127.0.0.1:0", "--advertise", "0.0.0.0")
    assert p.returncode == 2 and "--advertise" in p.stderr and "wildcard" in p.stderr, p.stderr


def test_the_daemon_on_a_wildcard_registers_its_advertised_address(tmp_path):
    """Bound on every interface, registered (and written to the ready file) as 127.0.0.1 with
    the port it bound; its node id defaults to that address; clients reach it through the
    masters, over TCP and the local path (whose socket is named after the advertised address)."""
    with LocalCluster(nodes=0, masters=1, root=str(tmp_path)) as cl:
        ready = tmp_path / "ready"
        proc = subprocess.Popen([*GCACHE, "daemon", "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1",
                                 "--mem", "16MiB", "--no-pretouch", "--masters", cl.master_url,
                                 "--token-file", str(cl.token_file), "--ready-file", str(ready)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            poll(lambda: ready.exists() and ready.read_text().strip(), 30)
            address = ready.read_text().strip()
            assert address.startswith("127.0.0.1:") and not address.endswith(":0")
            for local in (LocalPath.OFF, LocalPath.FORCE):
                with Client(cl.master_url, token=cl.token, timeout_s=5.0, local=local) as c:
                    nodes = c.membership.nodes
                    assert [(n.node_id, n.address) for n in nodes] == [(address, address)]
                    assert c.put([b"k"], [b"v"]) == [Status.OK] and c.get([b"k"]) == [b"v"]
        finally:
            proc.terminate()
            proc.wait(15)


def test_config_check_refuses_a_wildcard_listen_without_advertise(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nlisten = "0.0.0.0:7400"\n')
    good = tmp_path / "good.toml"
    good.write_text('[daemon]\nlisten = "0.0.0.0:7400"\nadvertise = "10.0.0.11"\n')
    p = subprocess.run([*GCACHE, "config", "check", str(bad)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 1 and f"{bad}:2: [daemon] listen:" in p.stderr and "advertise" in p.stderr, p.stderr
    p = subprocess.run([*GCACHE, "config", "check", str(good)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr


def test_drain_with_a_config_names_the_daemon_by_its_default_id_the_advertised_address():
    from gcache.ops.config import defaults_for

    doc = {"daemon": {"listen": "0.0.0.0:7400", "advertise": "10.0.0.11"}}
    assert defaults_for(doc, "drain")["node"] == "10.0.0.11:7400"
    assert defaults_for({"daemon": {**doc["daemon"], "node_id": "gpu-a"}}, "drain")["node"] == "gpu-a"
    assert defaults_for({"daemon": {"listen": "10.0.0.11:7400"}}, "drain")["node"] == "10.0.0.11:7400"


# -- the client ---------------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "t0k"])
def test_open_connection_checks_the_node_it_expects(token):
    with memory_cluster(1, token=token, tag=f"expect{token}") as (d,):
        conn = open_connection("other", d.address, 2.0, token, Transport.MEMORY)  # not asked: not checked
        conn.close()
        conn = open_connection(d.address, d.address, 2.0, token, Transport.MEMORY, check_node=True)
        conn.close()
        with pytest.raises(ConnectionFailed) as err:
            open_connection("node-x", d.address, 2.0, token, Transport.MEMORY, check_node=True)
        assert "node-x" in str(err.value) and repr(d.address) in str(err.value)


@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_a_client_whose_node_address_reaches_another_node_is_never_served(tmp_path, local):
    """node0's address in the client's membership leads to node1 (and node1's to node0), at the
    epoch and ring the masters publish. Before, that client's puts were acknowledged by the wrong
    daemons and its gets served their stale copies after the real owners were overwritten."""
    with LocalCluster(nodes=2, masters=1, mem="32MiB", root=str(tmp_path)) as cl:
        keys = [f"k{i}".encode() for i in range(40)]
        with Client(cl.master_url, token=cl.token, timeout_s=5.0) as good:
            real = good.membership
            assert sorted(n.node_id for n in real.nodes) == ["node0", "node1"]
            addr = {n.node_id: n.address for n in real.nodes}
            other = {"node0": addr["node1"], "node1": addr["node0"]}
            swapped = dataclasses.replace(real, nodes=tuple(dataclasses.replace(n, address=other[n.node_id])
                                                            for n in real.nodes))
            cfg = ClientConfig(token=cl.token, timeout_s=5.0, local=local, on_node_error=OnNodeError.MISS)
            with Client(swapped, cfg) as bad:
                stale = bad.put(keys, [b"stale"] * 40)
                assert good.put(keys, [b"new"] * 40) == [Status.OK] * 40
                got = bad.get(keys)
                assert set(stale) == {Status.UNAVAILABLE} and got == [None] * 40, (stale, got)
            with Client(swapped, dataclasses.replace(cfg, on_node_error=OnNodeError.RAISE)) as bad:
                with pytest.raises(ConnectionFailed) as err:
                    bad.get(keys)
                msg = str(err.value)
                assert "node0" in msg and "node1" in msg, msg
            assert good.get(keys) == [b"new"] * 40


def test_a_static_client_does_not_check_node_ids(tmp_path):
    """A static client names each daemon by its address; the daemon's id may be anything."""
    with LocalCluster(nodes=1, mem="32MiB", root=str(tmp_path)) as cl:
        with Client(cl.addresses, timeout_s=5.0) as c:
            assert c.put([b"k"], [b"v"]) == [Status.OK] and c.get([b"k"]) == [b"v"]
        m = Membership.from_addresses(cl.addresses)
        assert [n.node_id for n in m.nodes] == cl.addresses  # node name = address: nothing to check
