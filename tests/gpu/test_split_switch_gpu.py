"""Split switches on the GPU (dummy SmolLM2-135M shapes, bullet schedule with the slo policy, green contexts where
present): with `split_switch: overlap` each side moves at its next launch while its step in flight still runs on
the old partition (the next step waits on it), and the greedy tokens agree with the disjoint switch's (the same
kernels; bf16 near-ties between batchings aside); every KV block comes back.

Run: python -m pytest tests/gpu/test_split_switch_gpu.py -q
"""

from __future__ import annotations

import pytest

from tests.gpu.logged_run import run_logged

pytestmark = pytest.mark.gpu

PROMPTS = [[(11 * i + 5 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([700, 9, 1500, 40, 300, 2200, 5, 900])]


def _run(tmp_path, split_switch: str):
    # a TPOT target no step meets: whenever both sides are busy the policy moves SMs to decode, and back to
    # prefill when decode idles: switches throughout
    tokens, records, _ = run_logged(tmp_path / f"steps-{split_switch}.jsonl", PROMPTS, 48, schedule="bullet",
                                    split_policy="slo", max_num_batched_tokens=1024, tpot_target_ms=1e-3,
                                    split_switch=split_switch, async_scheduling=True)
    drains = [r for r in records if r["kind"] == "switch_drained"]
    return tokens, [r for r in records if r["kind"] == "switch"], [r for r in records if r["kind"] == "step"], drains


def test_overlap_switches_keep_the_tokens_of_disjoint_ones(tmp_path):
    disjoint, _, disjoint_steps, _ = _run(tmp_path, "disjoint")
    overlap, switches, steps, drains = _run(tmp_path, "overlap")
    assert all(len(t) == 48 for t in overlap)
    assert [t[0] for t in overlap] == [t[0] for t in disjoint]
    same = sum(a == b for o, d in zip(overlap, disjoint) for a, b in zip(o, d))
    assert same / sum(len(d) for d in disjoint) >= 0.9
    assert switches and all(r["overlap"] for r in switches)
    # the ordering under test happened: steps ran across a switch (collected after their side moved, or launched
    # before the other side followed), which the disjoint protocol never lets happen without layer groups
    assert any(r["across_switch"] for r in steps) and not any(r["across_switch"] for r in disjoint_steps)
    # a switch takes effect once no step of either side runs on the old entry (a step launched ahead still runs
    # there after both acked): each drain takes at least as long as its switch's ack (the two sides write their
    # records in either order: a drain timed by one side may reach the log just before the other's ack record)
    assert drains
    for drain in drains:
        acked = [r for r in switches if r["t"] <= drain["t"] + 0.05 and r["index"] == drain["index"]]
        assert acked and drain["decision_to_drained_us"] >= acked[-1]["decision_to_split_us"]
    print(f"switches {len(switches)}, drained {len(drains)}; ack p50 "
          f"{sorted(r['decision_to_split_us'] for r in switches)[len(switches) // 2] / 1e3:.2f} ms, drained p50 "
          f"{sorted(r['decision_to_drained_us'] for r in drains)[len(drains) // 2] / 1e3:.2f} ms")
