#!/usr/bin/env bash
# Report whether the MPS control daemon of deployment NAME runs on this node: bash deploy/mps/status.sh NAME [--root DIR]
# (pipe folder <root>/NAME/pipe; root $BULLET_RAY_MPS_ROOT or /tmp/bullet_ray/mps). Exit 0 on success (running).
set -euo pipefail
exec "${PYTHON:-python3}" -m bullet_ray.gpu.mps status "${1:?usage: status.sh NAME [--root DIR]}" "${@:2}"
