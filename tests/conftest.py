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
