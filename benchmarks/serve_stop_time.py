"""How long `serve run` takes to exit after Ctrl-C (SIGINT to its process group, as benchmarks/gpu/serve_h100.py
stops each system before the next), for one deployment YAML and extra environment. One request is served first,
so the replica has been used.

    python -m benchmarks.serve_stop_time deploy/local.yaml --env RAY_SERVE_THROUGHPUT_OPTIMIZED=1
    python -m benchmarks.serve_stop_time deploy/local.yaml --env RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
        --env RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"


def _ready(timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            urllib.request.urlopen(f"{URL}/v1/models", timeout=2).read()
            return time.monotonic() - started
        except OSError:
            time.sleep(1)
    raise SystemExit(f"error: not ready after {timeout_s:.0f} s (is another server on {URL}?)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_stop_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml", type=Path, help="deployment YAML for `serve run` (its HTTP port must be 8000)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="serve run's environment")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name of the one request")
    parser.add_argument("--timeout-s", type=float, default=240.0)
    args = parser.parse_args(argv)
    pairs = [item.partition("=") for item in args.env]
    if any(not key or not sep for key, sep, _ in pairs):
        parser.error("--env: give KEY=VALUE")
    if not args.yaml.is_file():
        parser.error(f"yaml: {args.yaml} is not a file")
    env = {**os.environ, **{key: value for key, _, value in pairs}}
    serve = str(Path(sys.executable).with_name("serve"))
    with open(os.devnull, "wb") as quiet:
        proc = subprocess.Popen([serve, "run", str(args.yaml)], cwd=REPO, start_new_session=True, env=env,
                                stdout=quiet, stderr=subprocess.STDOUT)
        try:
            ready_s = _ready(args.timeout_s)
            body = json.dumps({"model": args.model, "prompt": "Hi", "max_tokens": 4}).encode()
            req = urllib.request.Request(f"{URL}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
            stopped = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=args.timeout_s)
            stop_s = time.monotonic() - stopped
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    command = "python -m benchmarks.serve_stop_time " + " ".join(sys.argv[1:] if argv is None else argv)
    print(json.dumps({"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "ready_s": round(ready_s, 1), "stop_s": round(stop_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
