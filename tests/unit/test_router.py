"""Replica ranking of the request router (pure function, no Ray)."""

from __future__ import annotations

from bullet_ray.serve.router import rank_replicas


def test_ranks_by_predicted_ttft_when_every_replica_reports_one():
    stats = [{"predicted_ttft_s": 0.9, "num_waiting": 0}, {"predicted_ttft_s": 0.1, "num_waiting": 5},
             {"predicted_ttft_s": 0.4, "num_waiting": 1}]
    assert rank_replicas(stats) == [1, 2, 0]


def test_falls_back_to_least_loaded_without_predictions():
    stats = [{"predicted_ttft_s": None, "num_waiting": 3, "kv_usage": 0.1},
             {"num_waiting": 0, "kv_usage": 0.9, "num_running": 4},
             {"num_waiting": 0, "kv_usage": 0.2, "num_running": 9}]
    assert rank_replicas(stats) == [2, 1, 0]


def test_empty():
    assert rank_replicas([]) == []
