"""Prometheus metrics of one master, read from its node table at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

STATES = ("up", "suspect", "down", "draining")


class MasterCollector:
    def __init__(self, master: Any) -> None:
        self.master = master

    def collect(self) -> Iterator[GaugeMetricFamily]:
        h = self.master.health()  # from the master's core process
        states: dict[str, int] = h["states"]
        st = h["raft"]
        yield GaugeMetricFamily("gcache_membership_epoch", "membership epoch this master has applied", value=h["epoch"])
        nodes = GaugeMetricFamily("gcache_nodes", "nodes in the membership, by state", labels=["state"])
        for s in sorted(set(STATES) | set(states)):
            nodes.add_metric([s], states.get(s, 0))
        yield nodes
        yield GaugeMetricFamily("gcache_handover_pending", "nodes that have not finished the open handover",
                                value=h["handover_pending"])
        yield GaugeMetricFamily("gcache_master_is_leader", "1 on the Raft leader", value=1 if st.get("is_leader") else 0)
        yield GaugeMetricFamily("gcache_master_has_leader", "1 when this master knows a Raft leader",
                                value=1 if st.get("leader") else 0)
        yield GaugeMetricFamily("gcache_raft_term", "Raft term", value=st.get("term") or 0)
        yield GaugeMetricFamily("gcache_raft_commit_index", "Raft commit index", value=st.get("commit_idx") or 0)
