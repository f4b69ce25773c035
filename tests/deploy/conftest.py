"""A live cluster with metrics ports, shared by the health and dashboard tests (starting one
costs seconds on a busy machine). Tests may drain a node; none stops one."""

from __future__ import annotations

import pytest

from gcache.cluster import LocalCluster


@pytest.fixture(scope="session")
def metrics_cluster(tmp_path_factory):
    c = LocalCluster(nodes=2, mem="16MiB", masters=1, disk="32MiB", root=str(tmp_path_factory.mktemp("live")),
                     extra_args=["--metrics-port", "0", "--no-pretouch"], master_args=["--metrics-port", "0"])
    yield c.start()
    c.stop()
