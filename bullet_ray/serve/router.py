"""Routes each request to the engine replica expected to start it soonest.

Engine replicas report (record_routing_stats) their predicted TTFT, waiting and running requests and KV
usage. The router ranks candidates by predicted TTFT when every candidate has one, else by waiting
requests, then KV usage, then running requests (least loaded first). Ties keep Serve's random order.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def replica_rank_key(stats: dict[str, Any], use_ttft: bool) -> tuple[float, ...]:
    """Sort key of one replica (smaller is better); pure, so it is unit-tested without Ray."""
    waiting = float(stats.get("num_waiting", 0))
    kv = float(stats.get("kv_usage", 0.0))
    running = float(stats.get("num_running", 0))
    if use_ttft:
        return (float(stats["predicted_ttft_s"]), waiting, kv, running)
    return (waiting, kv, running)


def rank_replicas(stats_by_replica: list[dict[str, Any]]) -> list[int]:
    """Indexes of replicas, best first."""
    use_ttft = bool(stats_by_replica) and all(s.get("predicted_ttft_s") is not None for s in stats_by_replica)
    order = list(range(len(stats_by_replica)))
    random.shuffle(order)
    return sorted(order, key=lambda i: replica_rank_key(stats_by_replica[i], use_ttft))


class PredictedTTFTRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        stats = [dict(r.routing_stats or {}) for r in candidate_replicas]
        return [[candidate_replicas[i]] for i in rank_replicas(stats)]
