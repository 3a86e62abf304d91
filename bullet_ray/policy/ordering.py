"""Order the prefill queue: least slack first, then shorter jobs forward where no target breaks.

slack_r = target_r - waited_r - own_r       (own_r: r's prefill alone on the prefill side's SMs)

1. Requests that can still meet their target (slack >= 0) run first, least slack first (ties: the one
   that waited longest); requests that cannot (slack < 0) follow in arrival order: they count against
   goodput whatever happens, so they must not push others past their targets.
2. Then, pass after pass, a request moves ahead of its neighbour when it is shorter and both still meet
   their targets afterwards (served one after the other), which lowers mean TTFT without breaking any
   target (Bullet orders by estimated latency where no TTFT target breaks). Swapping two neighbours does
   not change when anyone behind them finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import QueuedRequest


def least_slack_order(queue: Sequence[QueuedRequest], own_s: Callable[[QueuedRequest], float],
                      targets: SloTargets, start_s: float = 0.0, max_passes: int = 8) -> list[QueuedRequest]:
    """The queue in the order it should be prefilled; `start_s`: time until the prefill side is free."""
    own = {r.request_id: own_s(r) for r in queue}
    target = {r.request_id: targets.ttft_target_s(r.num_prompt_tokens) for r in queue}

    def slack(r: QueuedRequest) -> float:
        return target[r.request_id] - r.waited_s - own[r.request_id] - start_s

    # a prompt whose prefill already started stays first: its blocks and chunk are in flight
    started = [r for r in queue if r.num_computed_tokens > 0]
    rest = [r for r in queue if r.num_computed_tokens == 0]
    feasible = sorted((r for r in rest if slack(r) >= 0), key=lambda r: (slack(r), -r.waited_s))
    lost = sorted((r for r in rest if slack(r) < 0), key=lambda r: -r.waited_s)
    order = started + feasible + lost
    fixed = len(started)
    for _ in range(max_passes):
        moved = False
        t = start_s + sum(own[r.request_id] for r in order[:fixed])
        i = fixed
        while i < len(order) - 1:
            a, b = order[i], order[i + 1]
            oa, ob = own[a.request_id], own[b.request_id]
            if ob < oa and b.waited_s + t + ob <= target[b.request_id] \
                    and a.waited_s + t + ob + oa <= target[a.request_id] \
                    and (slack(a) < 0 or a.waited_s + t + oa <= target[a.request_id]):
                order[i], order[i + 1] = b, a
                moved = True
            t += own[order[i].request_id]
            i += 1
        if not moved:
            break
    return order
