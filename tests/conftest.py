import os

import pytest

from gcache.cluster import LocalCluster


@pytest.fixture
def make_cluster(tmp_path):
    """Start LocalClusters of real daemon processes; all are stopped at teardown."""
    clusters = []

    def make(nodes=3, mem="64MiB", disk=None, extra_args=()):
        root = tmp_path / f"cluster{len(clusters)}"
        os.makedirs(root)
        c = LocalCluster(nodes=nodes, mem=mem, disk=disk, root=str(root), extra_args=list(extra_args))
        clusters.append(c)
        return c.start()

    yield make
    for c in clusters:
        c.stop()


@pytest.fixture
def cluster(make_cluster):
    return make_cluster()


def sigstop(pid, timeout=5.0):
    """SIGSTOP ``pid`` and wait until the kernel reports it stopped (delivery is asynchronous:
    a process can still run for a moment after kill() returns)."""
    import signal

    from gcache.cluster import wait_stopped

    os.kill(pid, signal.SIGSTOP)
    assert wait_stopped(pid, timeout), f"process {pid} did not stop within {timeout}s"


@pytest.fixture
def netlab(tmp_path):
    """Build fault labs (tests.faultlab): ``netlab(**LabConfig fields)`` -> a started Lab of
    masters, daemons and a client driver, each in its own network namespace. Skips when
    namespaces cannot be created here (the reason says why); everything is removed afterwards."""
    from tests.faultlab import Lab, LabConfig, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(f"fault lab unavailable: {why}")
    labs = []

    def make(**config):
        lab = Lab(str(tmp_path / f"lab{len(labs)}"), LabConfig(**config))
        labs.append(lab)
        return lab.start()

    yield make
    for lab in labs:
        lab.close()


def poll(pred, timeout, every=0.02):
    """Call ``pred`` until it returns something true or ``timeout`` seconds pass; its last answer."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(every)
    return pred()


def read(store, key):
    """The bytes a Store holds for ``key`` (None on a miss), read the way the daemon reads them."""
    hit = store.acquire(key)
    if hit is None:
        return None
    try:
        return bytes(hit.view)
    finally:
        store.release(hit)


@pytest.fixture
def tiered(tmp_path):
    """make(mem=64 KiB, disk=4 MiB, **StoreConfig fields) -> a RAM + NVMe Store in tmp_path (the
    same directory each time: a second one recovers what the first wrote); all closed at teardown."""
    from gcache.tier.store import Store, StoreConfig

    stores = []

    def make(mem=64 << 10, disk=4 << 20, **kw):
        s = Store(StoreConfig(mem_bytes=mem, disk_dir=str(tmp_path / "disk"), disk_bytes=disk,
                              segment_bytes=256 << 10, **kw))
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()
