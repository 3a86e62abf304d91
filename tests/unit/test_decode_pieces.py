"""Decode steps in pieces (bullet_ray.engine.cuda_graphs): the just-in-time launch order of `DecodeGraphs._run_pieces`
on fake graphs and events (CPU): each piece after the second waits for the piece two before it, the hook runs at every
boundary, and a step that moves runs the rest of its pieces from the new partition's graphs (the last piece's output is
the step's), on the new stream, ordered after the old one. The real graphs: tests/gpu/test_decode_pieces_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bullet_ray.engine import cuda_graphs
from bullet_ray.engine.cuda_graphs import DecodeGraphs, StepGraph, piece_bounds


class FakeGraph:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(f"replay {self.name}")


class FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class FakeCuda:
    """torch.cuda's events and current stream as the pieces' launch uses them, logged."""

    def __init__(self, log: list[str], stream: FakeStream) -> None:
        self.log, self.stream, self.num_events = log, stream, 0
        cuda = self

        class Event:
            def __init__(self) -> None:
                self.id = cuda.num_events
                cuda.num_events += 1

            def record(self) -> None:
                pass

            def synchronize(self) -> None:
                cuda.log.append(f"wait end {self.id}")

        self.Event = Event

    def current_stream(self) -> FakeStream:
        return self.stream

    def set_stream(self, stream: FakeStream) -> None:
        self.log.append(f"set {stream.name}")
        self.stream = stream


def _graphs(pieces: int, log: list[str]) -> tuple[DecodeGraphs, dict[int, StepGraph]]:
    graphs = object.__new__(DecodeGraphs)  # only what _run_pieces reads: no model, no GPU
    steps = {key: StepGraph([FakeGraph(f"p{key}.{i}", log) for i in range(pieces)],  # type: ignore[misc]
                            torch.full((8, 2), float(key))) for key in (0, 1)}
    graphs.graphs = {(key, 8, "plan"): step for key, step in steps.items()}
    graphs.pieces, graphs.num_piece_moves, graphs.is_serving = pieces, 0, True
    return graphs, steps


@pytest.fixture
def fake(monkeypatch):
    log: list[str] = []
    cuda = FakeCuda(log, FakeStream("s0", log))
    monkeypatch.setattr(cuda_graphs.torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "set_stream", cuda.set_stream)
    return log, cuda


def test_pieces_launch_just_in_time_and_stay_put(fake):
    log, _ = fake
    graphs, steps = _graphs(4, log)
    calls = []

    def between() -> tuple[Any, Any]:
        calls.append(len(log))
        log.append("hook")
        return 0, None

    out = graphs._run_pieces(0, 8, "plan", steps[0], between)
    assert out is steps[0]
    assert log == ["replay p0.0", "hook", "replay p0.1", "wait end 0", "hook", "replay p0.2", "wait end 1", "hook",
                   "replay p0.3"]
    assert graphs.num_piece_moves == 0


def test_a_move_runs_the_rest_from_the_new_partitions_graphs(fake):
    log, cuda = fake
    graphs, steps = _graphs(4, log)
    new = FakeStream("s1", log)
    out = graphs._run_pieces(0, 8, "plan", steps[0], lambda: (1, new) if len(log) >= 3 else (0, None))
    assert out is steps[1]  # the step's hidden states: the last piece's, from partition 1's graphs
    assert log == ["replay p0.0", "replay p0.1", "wait end 0", "s1 waits for s0", "set s1", "replay p1.2",
                   "wait end 1", "replay p1.3"]
    assert cuda.stream is new and graphs.num_piece_moves == 1


def test_piece_bounds_cover_the_layers():
    assert piece_bounds(32, 8) == [(i, i + 4) for i in range(0, 32, 4)]
    assert piece_bounds(4, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # never more pieces than layers
