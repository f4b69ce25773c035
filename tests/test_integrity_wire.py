"""Data integrity over the wire, real daemons with disk: GETs racing DELETEs of disk-resident
keys resurrect nothing, and a short soak (mixed ops over TCP and shared memory, eviction and
demotion all the time, a kill -9 and restart) finds no wrong, stale or resurrected value."""

import threading

from gcache import Client, LocalPath, Status
from tests.conftest import poll

KB = 1024



def test_gets_sent_with_deletes_of_disk_keys_never_resurrect_them(make_cluster):
    c = make_cluster(nodes=1, mem="4MiB", disk="256MiB")
    rounds, n = 15, 64
    resurrected = acked = 0
    with Client(c.addresses, timeout_s=20.0, local=LocalPath.OFF) as writer, \
            Client(c.addresses, timeout_s=20.0, local=LocalPath.OFF) as getter, \
            Client(c.addresses, timeout_s=20.0, local=LocalPath.OFF) as deleter:
        for r in range(rounds):
            keys = [f"r{r}-k{i}" for i in range(n)]
            assert writer.put(keys, [bytes([i]) * 256 * KB for i in range(n)]) == [Status.OK] * n
            # 16 MiB through a 4 MiB arena: most keys are on disk once the queue drains
            assert poll(lambda: next(iter(writer.stats().values()))["demote_queue_bytes"] == 0, 20)
            barrier = threading.Barrier(2)
            out = {}

            def get(keys=keys, barrier=barrier, out=out):
                barrier.wait()
                out["get"] = getter.get(keys)

            def delete(keys=keys, barrier=barrier, out=out):
                # a few keys per request, from the end: a request's deletes run under one store
                # lock, so one request for all 64 could finish before the GET reads any disk key
                barrier.wait()
                out["del"] = [ok for i in range(n, 0, -8) for ok in deleter.delete(keys[i - 8:i])]

            threads = [threading.Thread(target=get), threading.Thread(target=delete)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert all(out["del"])  # every delete acknowledged a stored key
            acked += n
            after = getter.get(keys)
            resurrected += sum(v is not None for v in after)
        st = next(iter(writer.stats().values()))
    print(f"\n{acked} acknowledged deletes raced by GETs, {resurrected} resurrected; "
          f"{st.get('hits_nvme', 0)} disk hits, {st.get('promotions_dropped', 0)} promotions dropped")
    assert st.get("hits_nvme", 0) > 0  # the GETs did read from disk
    assert resurrected == 0


def test_a_short_soak_finds_nothing_wrong(tmp_path):
    from gcache.bench.soak import SoakConfig, run_soak

    report = run_soak(SoakConfig(seconds=20, root=str(tmp_path / "soak")))
    print("\n" + report.table())
    assert report.ops > 1000 and report.hits > 100 and report.restarted
    assert report.demotions > 0 and report.disk_hits > 0  # eviction and demotion did run
    assert (report.wrong, report.stale, report.resurrected) == (0, 0, 0)


def test_a_soak_whose_clients_give_up_all_the_time_finds_nothing_stale(tmp_path):
    """Calls time out after 5 ms, so clients keep resetting connections with requests the
    daemons are still serving and write the keys again: a write given up on may land only
    before the key's next acknowledged operation (Handler.write_guard)."""
    from gcache.bench.soak import SoakConfig, run_soak

    report = run_soak(SoakConfig(seconds=12, threads=8, timeout_s=0.005, kill_at=None, root=str(tmp_path / "soak")))
    print("\n" + report.table())
    assert report.puts_unknown > 20 and report.puts_acked > 20 and report.hits > 20
    assert (report.wrong, report.stale, report.resurrected) == (0, 0, 0)
