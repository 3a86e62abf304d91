"""Performance models and policies that turn measured step times and SLO targets into decisions."""
