"""gRPC API of bullet_ray: generate.proto and its generated Python stubs (checked in, so running the
server needs only grpcio and protobuf).

Regenerate after editing generate.proto (needs grpcio-tools): `bash scripts/gen_proto.sh`. It drops the
generated version gates, so the stubs run with protobuf >= 4.21 and grpcio >= 1.63 (the APIs they use).
"""
