"""How a CPU worker sizes its intra-op thread pool (bullet_ray.engine.worker.main.cpu_threads)."""

from bullet_ray.engine.worker.main import cpu_threads


def test_cpu_workers_share_the_cores_by_schedule():
    """The chunked schedule's one CPU worker takes every core; each side of the bullet schedule half of them while
    the other side has work, every core while it idles."""
    assert [cpu_threads("hybrid", n) for n in (None, 1, 2, 8)] == [1, 1, 2, 8]
    assert [cpu_threads(role, n) for role in ("prefill", "decode") for n in (1, 2, 8)] == [1, 1, 4, 1, 1, 4]
    assert [cpu_threads(role, 8, other_busy=False) for role in ("prefill", "decode", "hybrid")] == [8, 8, 8]


def test_available_cores_are_this_process_s_affinity():
    import os

    from bullet_ray.engine.worker.main import available_cores

    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert available_cores() == expected >= 1
