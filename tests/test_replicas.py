"""Issue 32: peer replicas for node loss (placement, replication, restore from a peer's RAM)."""

from __future__ import annotations

import os

import pytest

from snapsvc.distributed.replicas import node_id, place_replicas


def test_placement_ring_over_distinct_nodes():
    nodes = ["A", "A", "B", "B"]
    assert [place_replicas(nodes, r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    six = ["A", "A", "B", "B", "C", "C"]
    assert place_replicas(six, 0, 1) == [2]
    assert place_replicas(six, 5, 1) == [1]          # C's second rank -> A's second rank
    assert place_replicas(six, 0, 2) == [2, 4]       # two copies, two other nodes
    assert place_replicas(six, 2, 2) == [4, 0]
    # deterministic: the same answer on every rank, whatever the call order
    assert place_replicas(six, 3, 2) == place_replicas(list(six), 3, 2)
    # not enough nodes: other ranks, never the origin, never twice
    assert place_replicas(["A", "A", "A"], 0, 1) == [1]
    assert place_replicas(nodes, 0, 3) == [2, 1, 3]
    assert place_replicas(nodes, 0, 0) == [] and place_replicas(["A"], 0, 1) == []


def test_node_id_order(monkeypatch):
    monkeypatch.delenv("SNAPSVC_NODE", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    import socket
    assert node_id() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_id() == "3"
    monkeypatch.setenv("SNAPSVC_NODE", "b")
    assert node_id() == "b"
