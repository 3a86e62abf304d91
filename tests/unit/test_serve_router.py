"""Replica ranking of the request router (pure functions, no Ray)."""

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


def test_requests_in_flight_since_the_last_report_count_as_waiting():
    stats = [{"num_waiting": 1}, {"num_waiting": 2}]
    assert rank_replicas(stats, in_flight=[0, 0]) == [0, 1]
    assert rank_replicas(stats, in_flight=[3, 0]) == [1, 0]


def test_near_equal_predictions_are_decided_by_load():
    stats = [{"predicted_ttft_s": 0.200, "num_waiting": 4}, {"predicted_ttft_s": 0.210, "num_waiting": 0}]
    assert rank_replicas(stats) == [1, 0]
    stats[1]["predicted_ttft_s"] = 0.5
    assert rank_replicas(stats) == [0, 1]


def test_empty():
    assert rank_replicas([]) == []
