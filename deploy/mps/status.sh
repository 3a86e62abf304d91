#!/usr/bin/env bash
# Is the MPS daemon of deployment NAME running? bash deploy/mps/status.sh NAME (exit 0 yes, 1 no)
set -euo pipefail
python3 -c "import sys; from bullet_ray.gpu.mps import MpsDaemon; s = MpsDaemon(sys.argv[1]).status(); print(s); sys.exit(0 if s.is_running else 1)" "${1:?usage: status.sh NAME}"
