"""How an engine replica takes a controller decision (`EngineReplica.apply_policy` delegates here).

The replica picks its own entry of the decision (by replica id; the decision's default when it is not
named), then: split bounds -> `LLMEngine.set_split_bounds` (the state block's bounds, which the worker that
decides the split clamps to; engines without an SM split, such as the mock engine, skip them); SLO targets
-> the replica's attainment metric and target gauges, and `LLMEngine.set_slo_targets` (the state block's
target slots, which the split decider in the prefill worker follows from its next decision on);
admission -> the replica's AdmissionSettings, starting from the ones it had before the first decision (so
leaving `shed` mode restores them; an operator's runtime change, `reconfigure_admission`, changes those too). What is in force is exported as gauges and returned.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

from bullet_ray.control.decide import Decision, EngineDecision

logger = logging.getLogger(__name__)


def apply_decision(replica: Any, decision: dict[str, Any]) -> dict[str, Any]:
    """Apply `decision` (Decision.to_dict()) to an EngineReplica; returns what is in force."""
    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    if decision.get("node_id") not in (None, node_id):
        return {"skipped": True}  # relayed by another node's agent
    decision = {k: v for k, v in decision.items() if k != "node_id"}
    mine: EngineDecision = Decision.from_dict(decision).for_engine(replica.replica_id)
    engine = replica.engine
    if not hasattr(replica, "_admission_before_control"):
        replica._admission_before_control = replica.admission
    base = replica._admission_before_control
    overrides = {k: v for k, v in (("max_waiting_per_engine", mine.max_waiting_per_engine),
                                   ("admission_ttft_s", mine.admission_ttft_s)) if v is not None}
    replica.admission = base.updated(overrides)
    ttft_s = mine.ttft_target_ms / 1e3 if mine.ttft_target_ms is not None else replica.metrics.ttft_target_s
    tpot_s = mine.tpot_target_ms / 1e3 if mine.tpot_target_ms is not None else replica.metrics.tpot_target_s
    replica.metrics.set_targets(ttft_s, tpot_s)
    if hasattr(engine, "set_slo_targets"):  # the split decision in the workers aims at them too
        engine.set_slo_targets(ttft_s, tpot_s)
    bounds: tuple[int, int] | None = None
    if hasattr(engine, "set_split_bounds"):
        lo, hi = engine.set_split_bounds(mine.min_decode_sms, mine.max_decode_sms)
        bounds = (engine.ladder_decode_sms[lo], engine.ladder_decode_sms[hi])
        replica.metrics.set_limits(bounds[0], bounds[1], replica.admission.max_waiting_per_engine)
    else:
        replica.metrics.max_waiting.set(replica.admission.max_waiting_per_engine)
    logger.info("decision %s for engine %s: decode SMs %s, targets %.3f/%.3f s, admission %s (%s)",
                decision.get("seq"), replica.replica_id, bounds, ttft_s, tpot_s, replica.admission, mine.reason)
    return {"engine_id": replica.replica_id, "seq": decision.get("seq"),
            "node_id": node_id,
            "decode_sms_bounds": bounds, "ttft_target_s": ttft_s, "tpot_target_s": tpot_s,
            "admission": dataclasses.asdict(replica.admission)}


def reconfigure_admission(replica: Any, user_config: dict[str, Any]) -> None:
    """An operator's runtime admission change (the deployment's user_config): in force now, and the base the
    controller's next decisions start from, so a decision does not undo it."""
    replica.admission = replica.admission.updated(user_config)
    base = getattr(replica, "_admission_before_control", None)
    if base is not None:
        replica._admission_before_control = base.updated(user_config)
