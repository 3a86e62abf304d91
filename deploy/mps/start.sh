#!/usr/bin/env bash
# Start the MPS control daemon of deployment NAME on this node: bash deploy/mps/start.sh NAME
set -euo pipefail
python3 -c "import sys; from bullet_ray.gpu.mps import MpsDaemon; s = MpsDaemon(sys.argv[1]).start(); print(s.pipe_dir)" "${1:?usage: start.sh NAME}"
