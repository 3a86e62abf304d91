#!/usr/bin/env bash
# Stop the MPS control daemon of deployment NAME on this node: bash deploy/mps/stop.sh NAME [--root DIR]
# (pipe folder <root>/NAME/pipe; root $BULLET_RAY_MPS_ROOT or /tmp/bullet_ray/mps). Exit 0 on success.
set -euo pipefail
exec "${PYTHON:-python3}" -m bullet_ray.gpu.mps stop "${1:?usage: stop.sh NAME [--root DIR]}" "${@:2}"
