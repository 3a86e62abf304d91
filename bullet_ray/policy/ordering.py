"""Order the prefill queue: least slack first, then shorter jobs forward where no target breaks.

slack_r = target_r - waited_r - own_r       (own_r: r's prefill alone on the prefill side's SMs)

1. Requests that can still meet their target (slack >= 0) run first, least slack first (ties: the one
   that waited longest); requests that cannot (slack < 0) follow in arrival order: they count against
   goodput whatever happens, so they must not push others past their targets.
   With a fallback target (SloTargets.fallback_ttft_s, e.g. the relaxed SLO's 1 s), a lost request that can
   still make the fallback is rescued: least fallback slack first, each moves to the latest place where
   it makes its fallback and every request behind it still makes the target it is planned for (its own,
   or the fallback for a rescued one), i.e. into the slack the others leave, keeping the slack before it
   for requests that still make their own. One that fits nowhere before the lost ones goes first among them.
   With `max_on_time` (EngineConfig.prefill_order "max_on_time"), the requests that can each still make their
   target are cut further to the most that can make it together, Moore and Hodgson's rule for the fewest late
   jobs on one machine: in deadline order (target - waited), add each one; when the one added would finish late,
   the longest prompt so far goes to the lost ones. A long prompt that would push several short ones past their
   targets is given up at once, instead of being served when it can no longer make its own (least slack alone
   counts each request's own prefill, not the queue ahead of it). The kept ones run in deadline order.
   With `fallback_first` (EngineConfig.prefill_order "fallback_first"), the same rule counts the fallback target
   first: the most requests that make their fallback together are kept (Moore-Hodgson on fallback deadlines), and
   among them as many as can still make their own target are planned for it (`most_within_fallback`: deadline order,
   each kept one due at its own target where it can make it alone, else at its fallback; while a placed one would
   be late, the longest one up to it due at its own target is planned for its fallback instead and moves back). A long
   prompt that the strict count gives up, but that still makes the fallback, is kept, and short ones may slip past
   their own targets (not past their fallback) to make room: the order that counts the relaxed SLO first. Without
   a fallback target it is max_on_time (EngineConfig refuses fallback_first without ttft_fallback_ms).
2. Then, pass after pass, a request moves ahead of its neighbour when it is shorter and both still meet
   their targets afterwards (served one after the other), which lowers mean TTFT without breaking any
   target (Bullet orders by estimated latency where no TTFT target breaks). Swapping two neighbours does
   not change when anyone behind them finishes.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence

from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import QueuedRequest

# the orders least_slack_order knows (EngineConfig.prefill_order's choices: bullet_ray.config.PREFILL_ORDERS)
ORDERS: tuple[str, ...] = ("least_slack", "max_on_time", "fallback_first")


def least_slack_order(queue: Sequence[QueuedRequest], own_s: Callable[[QueuedRequest], float],
                      targets: SloTargets, start_s: float = 0.0, max_passes: int = 8,
                      order: str = "least_slack") -> list[QueuedRequest]:
    """The queue in the order it should be prefilled; `start_s`: time until the prefill side is free; `order`:
    EngineConfig.prefill_order (PREFILL_ORDERS): "max_on_time" keeps only the most requests that can make their
    targets together, "fallback_first" the most that make their fallback targets, as many of them as can within
    their own (module docstring, 1.)."""
    if order not in ORDERS:
        raise ValueError(f"unknown prefill order {order!r}; choose {', '.join(ORDERS)}")
    own = {r.request_id: own_s(r) for r in queue}
    target = {r.request_id: targets.ttft_target_s(r.num_prompt_tokens) for r in queue}

    def slack(r: QueuedRequest) -> float:
        return target[r.request_id] - r.waited_s - own[r.request_id] - start_s

    # a prompt whose prefill already started stays first: its blocks and chunk are in flight
    started = [r for r in queue if r.num_computed_tokens > 0]
    rest = [r for r in queue if r.num_computed_tokens == 0]
    feasible = sorted((r for r in rest if slack(r) >= 0), key=lambda r: (slack(r), -r.waited_s))
    lost = [r for r in rest if slack(r) < 0]
    t0 = start_s + sum(own[r.request_id] for r in started)
    fixed = len(started)
    if order == "fallback_first" and targets.fallback_ttft_s is not None:
        fallback = {r.request_id: targets.fallback_target_s(r.num_prompt_tokens) or target[r.request_id] for r in rest}
        can_make = [r for r in rest if fallback[r.request_id] - r.waited_s - own[r.request_id] - t0 >= 0]
        kept, given_up = most_on_time(can_make, own, {r.request_id: fallback[r.request_id] - r.waited_s
                                                      for r in can_make}, t0)
        made = {r.request_id for r in can_make}
        lost = sorted(given_up + [r for r in rest if r.request_id not in made], key=lambda r: -r.waited_s)
        ordered = started + most_within_fallback(kept, own, {r.request_id: target[r.request_id] - r.waited_s
                                                             for r in kept},
                                                 {r.request_id: fallback[r.request_id] - r.waited_s for r in kept}, t0)
        ordered += lost
    else:
        if order in ("max_on_time", "fallback_first"):  # fallback_first without a fallback target: max_on_time
            feasible, given_up = most_on_time(feasible, own, {r.request_id: target[r.request_id] - r.waited_s
                                                              for r in feasible}, t0)
            lost += given_up
        lost.sort(key=lambda r: -r.waited_s)
        if targets.fallback_ttft_s is None:
            ordered = started + feasible + lost
        else:
            ordered = _rescue(started + feasible, lost, fixed, own, target, targets, start_s)
    for _ in range(max_passes):
        moved = False
        t = start_s + sum(own[r.request_id] for r in ordered[:fixed])
        i = fixed
        while i < len(ordered) - 1:
            a, b = ordered[i], ordered[i + 1]
            oa, ob = own[a.request_id], own[b.request_id]
            if ob < oa and b.waited_s + t + ob <= target[b.request_id] \
                    and a.waited_s + t + ob + oa <= target[a.request_id] \
                    and (slack(a) < 0 or a.waited_s + t + oa <= target[a.request_id]):
                ordered[i], ordered[i + 1] = b, a
                moved = True
            t += own[ordered[i].request_id]
            i += 1
        if not moved:
            break
    return ordered


def most_on_time(candidates: Sequence[QueuedRequest], own: dict[str, float], deadline: dict[str, float],
                 start_s: float) -> tuple[list[QueuedRequest], list[QueuedRequest]]:
    """(kept in deadline order, given up): the largest subset of `candidates` that all finish by their deadlines
    when served one after another from `start_s` (Moore-Hodgson: deadline order, dropping the longest kept one
    whenever the one just added would be late; optimal for the count of on-time jobs released together)."""
    ordered = sorted(candidates, key=lambda r: (deadline[r.request_id], -r.waited_s))
    longest: list[tuple[float, int]] = []  # a max-heap of the kept ones' times: (-own, index in `ordered`)
    dropped: set[int] = set()
    t = start_s
    for i, r in enumerate(ordered):
        heapq.heappush(longest, (-own[r.request_id], i))
        t += own[r.request_id]
        if t > deadline[r.request_id]:
            neg, j = heapq.heappop(longest)
            dropped.add(j)
            t += neg
    return [r for i, r in enumerate(ordered) if i not in dropped], [ordered[j] for j in sorted(dropped)]


def most_within_fallback(kept: Sequence[QueuedRequest], own: dict[str, float], deadline: dict[str, float],
                         fallback: dict[str, float], start_s: float) -> list[QueuedRequest]:
    """`kept` (requests that all make their `fallback` deadlines together, served one after another from `start_s`:
    most_on_time's kept set on those deadlines) in the order that keeps as many of them within their own `deadline`
    as this greedy finds: each is due at its own deadline where it makes it alone, else at its fallback, and the
    placed ones stay in order of due time; each is placed in turn, and while a placed one ends past its due time,
    the longest one up to it that is due at its own deadline is due at its fallback instead and moves back to its
    new place (Moore-Hodgson's step, with the dropped job kept). Every request of `kept` makes at least its
    fallback: the placed ones in order of due time end late only where one up to the late one is still due at its
    own deadline (with every one due at its fallback, the order is a prefix of the fallback deadlines' order, which
    the kept set meets)."""
    index = {r.request_id: i for i, r in enumerate(kept)}
    due = {r.request_id: deadline[r.request_id] if start_s + own[r.request_id] <= deadline[r.request_id]
           else fallback[r.request_id] for r in kept}

    def key(r: QueuedRequest) -> tuple[float, float, int]:
        return due[r.request_id], -r.waited_s, index[r.request_id]

    def first_late(placed: list[QueuedRequest]) -> int | None:
        t = start_s
        for i, r in enumerate(placed):
            t += own[r.request_id]
            if t > due[r.request_id]:
                return i
        return None

    placed: list[QueuedRequest] = []
    for r in sorted(kept, key=key):
        bisect.insort(placed, r, key=key)
        while (late := first_late(placed)) is not None:
            movable = [q for q in placed[:late + 1] if due[q.request_id] < fallback[q.request_id]]
            if not movable:  # not for a set that makes its fallbacks together (docstring); kept as it stands
                break
            moved = max(movable, key=lambda q: (own[q.request_id], -index[q.request_id]))
            placed.remove(moved)
            due[moved.request_id] = fallback[moved.request_id]
            bisect.insort(placed, moved, key=key)
    return placed


def _rescue(placed: list[QueuedRequest], lost: list[QueuedRequest], fixed: int, own: dict[str, float],
            target: dict[str, float], targets: SloTargets, start_s: float) -> list[QueuedRequest]:
    """`placed` (started, then feasible) with every lost request that can still make its fallback target moved
    into the slack of those behind it (module docstring, 1.); the rest of `lost` after them, in its order."""
    fallback = {r.request_id: targets.fallback_target_s(r.num_prompt_tokens) or target[r.request_id] for r in lost}

    def fb_slack(r: QueuedRequest) -> float:
        return fallback[r.request_id] - r.waited_s - own[r.request_id] - start_s

    due = {r.request_id: target[r.request_id] for r in placed}  # what each placed request is planned to make
    order = list(placed)
    behind: list[QueuedRequest] = []  # rescuable, but only after every placed request
    for r in sorted((r for r in lost if fb_slack(r) >= 0), key=lambda r: (fb_slack(r), -r.waited_s)):
        # spare[i]: how much later order[i:] may all finish and still make what they are planned for
        starts, t = [], start_s
        for q in order:
            starts.append(t)
            t += own[q.request_id]
        spare = [float("inf")] * (len(order) + 1)
        for i in range(len(order) - 1, -1, -1):
            q = order[i]
            margin = due[q.request_id] - q.waited_s - starts[i] - own[q.request_id]
            spare[i] = min(spare[i + 1], margin if margin >= 0 else float("inf"))  # a late one has none to lose
        starts.append(t)
        fits = [i for i in range(fixed, len(order) + 1) if spare[i] >= own[r.request_id]
                and r.waited_s + starts[i] + own[r.request_id] <= fallback[r.request_id]]
        if fits:  # the latest such place: the slack before it stays for requests that still make their targets
            order.insert(fits[-1], r)
            due[r.request_id] = fallback[r.request_id]
        else:
            behind.append(r)
    rescued = {r.request_id for r in order} | {r.request_id for r in behind}
    return order + behind + [r for r in lost if r.request_id not in rescued]


def head_target_s(head: QueuedRequest, own_s: float, targets: SloTargets, start_s: float = 0.0) -> float:
    """The TTFT target the batch behind `head` (the order's first) is fitted to: the head's own, or, when it can no
    longer make that one, its fallback target (SloTargets.fallback_ttft_s) if it still makes that: a rescued head
    must not let its batch grow as if it were lost for good."""
    target = targets.ttft_target_s(head.num_prompt_tokens)
    fallback = targets.fallback_target_s(head.num_prompt_tokens)
    if fallback is not None and head.waited_s + start_s + own_s > target:
        return fallback
    return target
