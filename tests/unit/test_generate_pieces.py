"""LLMEngine.generate sends its list in AddRequests pieces of a bounded number of prompt tokens (one write each)."""

from __future__ import annotations

from bullet_ray.engine.messages import AddRequest, AddRequests
from bullet_ray.engine.sampling_params import SamplingParams


def _add(rid: str, n: int) -> AddRequest:
    return AddRequest(rid, [1] * n, SamplingParams(max_tokens=1), 0.0, 4096)


def test_pieces_keep_the_order_and_stay_under_the_bound_unless_one_prompt_is_over_it():
    adds = [_add(str(i), n) for i, n in enumerate([400, 300, 300, 1000, 5000, 10, 10])]
    pieces = list(AddRequests.pieces(adds, 1000))
    assert [[a.request_id for a in p] for p in pieces] == [["0", "1", "2"], ["3"], ["4"], ["5", "6"]]
    assert [a for p in pieces for a in p] == adds  # every request once, in order
    assert all(sum(len(a.prompt_token_ids) for a in p) <= 1000 for p in pieces if len(p) > 1)
    assert list(AddRequests.pieces([], 1000)) == []
    assert len(list(AddRequests.pieces(adds))) == 1  # the default bound: ~256k prompt tokens
