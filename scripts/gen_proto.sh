#!/usr/bin/env bash
# Regenerate bullet_ray/serve/proto's stubs from generate.proto (needs grpcio-tools), then drop the
# generated version gates: the stubs only use APIs that protobuf >= 4.21 and grpcio >= 1.60 have, and the
# gates would refuse older runtimes that serve them fine (the GPU machine's image has grpcio 1.84).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. bullet_ray/serve/proto/generate.proto
python - <<'PY'
import re
from pathlib import Path

proto = Path("bullet_ray/serve/proto")
pb2 = proto / "generate_pb2.py"
text = pb2.read_text()
text = re.sub(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", text)
pb2.write_text(text)
grpc_file = proto / "generate_pb2_grpc.py"
text = grpc_file.read_text()
text = re.sub(r"\nGRPC_GENERATED_VERSION = .*?\n    \)\n", "\n", text, flags=re.S)
text = text.replace("import warnings\n", "")
grpc_file.write_text(text)
for path in (pb2, grpc_file, proto / "generate_pb2.pyi"):
    body = path.read_text()
    if not body.startswith("# ruff: noqa"):
        path.write_text("# ruff: noqa\n" + body)
PY
