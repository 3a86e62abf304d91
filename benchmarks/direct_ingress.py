"""Ray Serve's direct ingress (experimental in Ray 2.60): where an application's replica serves HTTP.

With RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in the environment of the process that starts Ray, each ingress replica
serves HTTP itself on its own port (30000 and up) and the Serve proxy's port no longer answers for the app. The
only way to learn that port is the Serve controller's target groups, a private Ray API; this module reads them
for benchmarks.hops (a driver already connected to the cluster: `replica_url`) and for benchmarks.gpu.serve_h100
(a cluster that `serve run` started in another process: `find_replica_url`, which polls a child process,
`python -m benchmarks.direct_ingress <app>`, so that no Ray driver runs in the benchmark client's process).

    python -m benchmarks.direct_ingress bullet --timeout-s 60     # prints http://127.0.0.1:<port>
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
NOT_RUNNING_EXIT_CODE = 3  # the child's exit code when no replica of the app served HTTP before its deadline


def replica_url(app_name: str, host: str = "127.0.0.1") -> str | None:
    """The HTTP address of the application's (first) ingress replica, or None while it has no running replica
    with a port (the controller then lists the Serve proxies instead, whose names say so). Needs a driver
    connected to the cluster. `host`: the replica listens on http_options' host (127.0.0.1 or 0.0.0.0 in
    deploy/*.yaml, both reachable here), not on the node IP the controller reports."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve._private.constants import SERVE_PROXY_NAME
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # raises while no Serve controller runs
    if client is None:
        return None
    groups = ray.get(client._controller.get_target_groups.remote(app_name))
    targets = [t for g in groups if g.protocol == RequestProtocol.HTTP for t in g.targets
               if not t.name.startswith(SERVE_PROXY_NAME)]
    return f"http://{host}:{targets[0].port}" if targets else None


def _poll_in_this_process(app_name: str, timeout_s: float, poll_s: float = 1.0) -> str | None:
    """Connect to the running cluster (retrying until it is up), then poll `replica_url` until the deadline."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not ray.is_initialized():
        try:
            ray.init(address="auto", namespace="serve", log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as e:  # `serve run` has not started its cluster yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ray cluster to connect to within {timeout_s:.0f} s: {e}") from e
            time.sleep(poll_s)
    try:
        while True:
            try:
                url = replica_url(app_name)
            except Exception as e:  # noqa: BLE001 — the controller may not exist yet right after the cluster starts
                logger.info("no Serve controller yet: %s", e)
                url = None
            if url is not None or time.monotonic() > deadline:
                return url
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def find_replica_url(app_name: str, timeout_s: float, server: subprocess.Popen | None = None) -> str:
    """From a process outside the cluster: the app's replica HTTP address once a replica is running, found by
    a child process (`python -m benchmarks.direct_ingress`). Raises RuntimeError if `server` (the `serve run`
    that owns the cluster) exits first or the child fails, TimeoutError after `timeout_s`."""
    cmd = [sys.executable, "-m", "benchmarks.direct_ingress", app_name, "--timeout-s", str(timeout_s)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])  # the repo root: benchmarks importable
    deadline = time.monotonic() + timeout_s + 60  # the child's own deadline, plus its Ray import and connect
    try:
        while child.poll() is None:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"serve run exited with code {server.returncode} before application "
                                   f"{app_name!r} had a replica serving HTTP")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica URL for application {app_name!r} within {timeout_s:.0f} s")
            time.sleep(0.5)
        out, err = child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode == NOT_RUNNING_EXIT_CODE:
        raise TimeoutError(f"application {app_name!r} had no replica serving HTTP within {timeout_s:.0f} s "
                           f"(is {ENV_VAR}=1 set where Ray starts?)")
    if child.returncode != 0 or not out.strip().startswith("http://"):
        raise RuntimeError(f"replica URL lookup failed (exit {child.returncode}): {err.strip()[-2000:]}")
    return out.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("app_name", help="the Serve application's name (deploy/*.yaml: bullet)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait for a running replica")
    args = parser.parse_args(argv)
    url = _poll_in_this_process(args.app_name, args.timeout_s)
    if url is None:
        print(f"application {args.app_name!r}: no replica serving HTTP within {args.timeout_s:.0f} s",
              file=sys.stderr)
        return NOT_RUNNING_EXIT_CODE
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
