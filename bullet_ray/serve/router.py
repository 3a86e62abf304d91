"""Routes each request to the engine replica expected to start it soonest (a Ray Serve RequestRouter).

Engine replicas report (`record_routing_stats`, every `request_routing_stats_period_s`) their predicted
TTFT, waiting and running requests and KV usage. The router ranks candidates by predicted TTFT when
every candidate has one, else by load: waiting requests, then KV usage, then running requests. Reports
are up to a period old, so the router adds the requests it sent to each replica and has not seen
complete to the replica's waiting count, and treats predicted TTFTs within `TTFT_RESOLUTION_S` of each
other as equal: a burst inside one report period spreads over the replicas instead of piling onto the
one that looked best. Remaining ties keep a random order (Serve then tries the ranks in turn).
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# predicted TTFTs closer than this are treated as equal (then load decides)
TTFT_RESOLUTION_S = 0.05


def replica_rank_key(stats: dict[str, Any], use_ttft: bool, num_in_flight: int = 0) -> tuple[float, ...]:
    """Sort key of one replica (smaller is better); pure, so it is unit-tested without Ray."""
    waiting = float(stats.get("num_waiting", 0)) + num_in_flight
    kv = float(stats.get("kv_usage", 0.0))
    running = float(stats.get("num_running", 0))
    if use_ttft:
        return (round(float(stats["predicted_ttft_s"]) / TTFT_RESOLUTION_S), waiting, kv, running)
    return (waiting, kv, running)


def rank_replicas(stats_by_replica: list[dict[str, Any]], in_flight: list[int] | None = None) -> list[int]:
    """Indexes of replicas, best first."""
    in_flight = in_flight or [0] * len(stats_by_replica)
    use_ttft = bool(stats_by_replica) and all(s.get("predicted_ttft_s") is not None for s in stats_by_replica)
    order = list(range(len(stats_by_replica)))
    random.shuffle(order)
    return sorted(order, key=lambda i: replica_rank_key(stats_by_replica[i], use_ttft, in_flight[i]))


class PredictedTTFTRouter(FIFOMixin, RequestRouter):
    """Serve request router of the engine deployment (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        # requests this router sent to a replica that have not completed yet
        self._num_in_flight: dict[Any, int] = defaultdict(int)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        stats = [dict(r.routing_stats or {}) for r in candidate_replicas]
        in_flight = [self._num_in_flight.get(r.replica_id, 0) for r in candidate_replicas]
        return [[candidate_replicas[i]] for i in rank_replicas(stats, in_flight)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        self._num_in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        if self._num_in_flight.get(replica_id, 0) > 0:
            self._num_in_flight[replica_id] -= 1
