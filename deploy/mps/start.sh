#!/usr/bin/env bash
# Start the MPS control daemon of deployment NAME on this node: bash deploy/mps/start.sh NAME [--root DIR]
# (pipe folder <root>/NAME/pipe; root $BULLET_RAY_MPS_ROOT or /tmp/bullet_ray/mps). Exit 0 on success.
set -euo pipefail
exec "${PYTHON:-python3}" -m bullet_ray.gpu.mps start "${1:?usage: start.sh NAME [--root DIR]}" "${@:2}"
