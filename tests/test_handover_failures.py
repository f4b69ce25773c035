"""A handover push that does not land must not leave the previous owner a copy it could serve
again: real daemons and a master on loopback.

Found by an adversarial probe: n0 and n1 hold ~1.5 MB values; n2 joins with a smaller
``--max-value``, so n0's and n1's pushes of those values are refused (TOO_LARGE) and they kept
their copies; a client writes newer (small) values of the keys that moved to n2; n2 then leaves
(killed and declared down, or drained). The ring gives the keys back to n0/n1, which served their
old copies: 12 of 12 stale in both modes before the fix. Afterwards a read is a miss or the
newer value."""

import signal

import pytest

from gcache import Client, OnNodeError
from gcache.client.config import LocalPath
from gcache.cluster import LocalCluster
from gcache.meta.master_client import MasterClient
from tests.conftest import poll


@pytest.mark.parametrize("leaves", ["killed", "drained"])
def test_a_refused_push_leaves_no_copy_to_serve_when_the_new_owner_leaves(tmp_path, leaves):
    cl = LocalCluster(nodes=2, mem="96MiB", masters=1, root=str(tmp_path / "c")).start()
    try:
        mc = MasterClient(cl.master_url, cl.token, timeout_s=2.0)
        with Client(cl.master_url, token=cl.token, timeout_s=5.0, local=LocalPath.OFF,
                    on_node_error=OnNodeError.MISS) as c:
            keys = [b"key-%d" % i for i in range(24)]
            assert all(s.name == "OK" for s in c.put(keys, [b"OLD" * 500_000] * len(keys)))
            cl.extra_args = ["--max-value", "1MiB"]
            joiner = cl.add_node().node_id

            def settled():  # n2 is up, every handover reported
                m = mc.membership()
                return m["transition"] is None and any(r["id"] == joiner and r["state"] == "up" for r in m["nodes"])

            assert poll(settled, 30), "the join did not settle"
            assert poll(lambda: c.refresh_membership() or joiner in c.owners(keys), 10)
            moved = [k for k, o in zip(keys, c.owners(keys)) if o == joiner]
            assert moved, "no key moved to the joiner"
            # every push of a moved key was refused (too large for n2): n2 has none of them
            assert c.get(moved) == [None] * len(moved)
            assert all(s.name == "OK" for s in c.put(moved, [b"NEW" + k for k in moved]))
            if leaves == "killed":
                cl.kill(2, signal.SIGKILL)
            else:
                mc.call("Drain", {"node": joiner}, timeout_s=5)

            def gone():
                c.refresh_membership()
                return joiner not in c.owners(keys) and joiner not in {
                    r["id"] for r in mc.membership()["nodes"] if r["state"] in ("up", "suspect", "draining")}

            assert poll(gone, 30), f"{joiner} did not leave the ring"
            got = c.get(moved)
            stale = [k for k, g in zip(moved, got) if g is not None and bytes(g) != b"NEW" + k]
            assert not stale, f"{len(stale)} of {len(moved)} keys served an older value than acknowledged"
            # the keys n2 never owned are still there
            kept = [k for k in keys if k not in moved]
            assert sum(g is not None for g in c.get(kept)) >= len(kept) // 2
    finally:
        cl.stop()
