#!/usr/bin/env bash
# Stop the MPS control daemon of deployment NAME on this node: bash deploy/mps/stop.sh NAME
set -euo pipefail
python3 -c "import sys; from bullet_ray.gpu.mps import MpsDaemon; MpsDaemon(sys.argv[1]).stop()" "${1:?usage: stop.sh NAME}"
