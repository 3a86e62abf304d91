"""bullet_ray.serve."""
