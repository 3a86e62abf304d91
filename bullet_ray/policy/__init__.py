"""bullet_ray.policy."""
