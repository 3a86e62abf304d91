"""bullet_ray.control."""
