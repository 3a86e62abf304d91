"""bullet_ray.gpu."""
