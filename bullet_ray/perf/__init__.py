"""bullet_ray.perf."""
