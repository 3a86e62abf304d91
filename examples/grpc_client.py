"""Stream a completion from bullet_ray over gRPC (Serve's gRPC proxy, bullet_ray/serve/proto/generate.proto).

    serve run deploy/local.yaml                     # gRPC proxy on port 9000
    python examples/grpc_client.py "Once upon a time" --max-tokens 32
    python examples/grpc_client.py --chat "What is the capital of France?"

The proxy routes by the `application` metadata (the app's name in the YAML, "bullet"); with api_keys set,
pass --api-key to send `authorization: Bearer <key>`.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
from bullet_ray.serve.proto.generate_pb2_grpc import GeneratorStub


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--address", default="localhost:9000", help="host:port of a Serve gRPC proxy")
    parser.add_argument("--application", default="bullet", help="Serve application name")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)

    request = GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                              chat=args.chat)
    if args.seed is not None:
        request.seed = args.seed
    metadata = [("application", args.application)]
    if args.api_key:
        metadata.append(("authorization", f"Bearer {args.api_key}"))
    with grpc.insecure_channel(args.address) as channel:
        try:
            for response in GeneratorStub(channel).Generate(request, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    u = response.usage
                    print(f"\n[finish_reason={response.finish_reason} prompt_tokens={u.prompt_tokens} "
                          f"completion_tokens={u.completion_tokens}]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
