"""bullet_ray.policy: the per-step scheduler of the bullet schedule (Bullet's Algorithm 1), pure Python.

slo.py (targets), state.py (typed inputs and outputs), ordering.py (least slack without breaking another
target), buckets.py (length buckets that split and merge), batching.py (prefill batches up to where
arithmetic intensity saturates), split.py (the SM split rule with hysteresis), bullet.py (the coordinator:
`BulletPolicy.step`), ttft.py (the measured prefill-time fallback of the engine front's stats).
"""
