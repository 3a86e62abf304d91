"""The native SM-partition helper on a machine without a GPU, the partition backends, the switch protocol,
and MPS daemon management against a fake control binary."""

from __future__ import annotations

import os
import subprocess
import threading

import numpy as np
import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.gpu import smctl
from bullet_ray.gpu.mps import MpsDaemon, MpsNotRunningError, require_mps
from bullet_ray.gpu.partition import (
    LadderEntry,
    NonePartitioner,
    SplitSwitch,
    default_ladder,
    make_partitioner,
)

NATIVE = os.path.join(os.path.dirname(__file__), "..", "..", "native")


def _has_gpu() -> bool:
    try:
        smctl.capabilities(0)
        return True
    except smctl.SmctlError:
        return False


def test_library_builds_with_gcc_and_loads(tmp_path):
    subprocess.run(["make", "-s", "-C", NATIVE], check=True)
    assert smctl.version() == 100


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_no_driver_is_reported_cleanly():
    with pytest.raises(smctl.NoDriverError) as err:
        smctl.capabilities(0)
    assert "driver" in str(err.value).lower() or "cuinit" in str(err.value).lower()
    with pytest.raises(smctl.NoDriverError):
        smctl.NativeLadder(0, [16], smctl.SIDE_DECODE)
    # auto falls back to the none backend
    assert make_partitioner("auto", "decode").name == "none"


def test_native_rejects_bad_arguments_before_touching_the_driver():
    with pytest.raises(smctl.InvalidArgumentError):
        smctl.NativeLadder(0, [16], 7)
    with pytest.raises(smctl.InvalidArgumentError):
        smctl.NativeLadder(0, [], smctl.SIDE_DECODE)


def test_default_ladder_on_an_h100():
    assert default_ladder(132) == list(range(16, 117, 8))
    assert default_ladder(132)[0] == 16 and default_ladder(132)[-1] == 112


def test_none_backend_records_choices():
    p = make_partitioner("none", "both", decode_sm_counts=[16, 64, 112], sm_count=132)
    assert [(e.decode_sms, e.prefill_sms) for e in p.ladder] == [(16, 116), (64, 68), (112, 20)]
    p.select(2)
    p.select(0)
    assert p.current_index == 0 and p.history == [2, 0]
    assert p.current_stream("decode") is None


@pytest.mark.parametrize("kwargs,field", [
    ({"backend": "warp-drive", "side": "decode"}, "partition"),
    ({"backend": "none", "side": "middle"}, "side"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [0]}, "decode_sm_counts"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [200]}, "decode_sm_counts"),
])
def test_bad_partition_arguments_are_typed_errors(kwargs, field):
    with pytest.raises(ConfigError) as err:
        make_partitioner(**kwargs)
    assert err.value.field == field


def test_select_out_of_range():
    with pytest.raises(ConfigError):
        NonePartitioner("decode", 132, [16, 32]).select(5)


LADDER = [LadderEntry(0, 16, 116), LadderEntry(1, 64, 68), LadderEntry(2, 112, 20)]


def test_switch_shrinking_side_first_then_the_growing_side():
    slots = np.zeros(4, dtype=np.int64)
    sw = SplitSwitch(slots, LADDER)
    sw.reset(1)
    sw.request(2)  # decode grows 64 -> 112, prefill shrinks 68 -> 20
    assert sw.maybe_switch("decode") is None  # must wait for prefill to release SMs
    assert sw.maybe_switch("prefill") == 2
    assert sw.maybe_switch("decode") == 2
    sw.request(0)  # decode shrinks now
    assert sw.maybe_switch("prefill") is None
    assert sw.maybe_switch("decode") == 0
    assert sw.maybe_switch("prefill") == 0
    assert slots[3] == 2


def test_switch_never_overlaps_under_concurrent_polling():
    slots = np.zeros(4, dtype=np.int64)
    sw = SplitSwitch(slots, LADDER)
    sw.reset(0)
    overlaps = []
    stop = threading.Event()

    def side(name: str) -> None:
        while not stop.is_set():
            sw.maybe_switch(name)
            d, p = LADDER[sw.current("decode")], LADDER[sw.current("prefill")]
            if d.decode_sms + p.prefill_sms > 132:
                overlaps.append((d, p))

    threads = [threading.Thread(target=side, args=(n,)) for n in ("prefill", "decode")]
    for t in threads:
        t.start()
    for target in [2, 0, 1, 2, 1, 0] * 20:
        sw.request(target)
    stop.set()
    for t in threads:
        t.join()
    assert not overlaps


def _fake_control(tmp_path) -> str:
    """A stand-in for nvidia-cuda-mps-control: -d creates the control pipe, 'quit' removes it."""
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text("#!/bin/sh\n"
                      "if [ \"$1\" = \"-d\" ]; then mkdir -p \"$CUDA_MPS_PIPE_DIRECTORY\"; "
                      "touch \"$CUDA_MPS_PIPE_DIRECTORY/control\"; exit 0; fi\n"
                      "read cmd; case \"$cmd\" in quit) rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\";; "
                      "get_server_list) echo 1234;; esac\n")
    script.chmod(0o755)
    return str(script)


def test_mps_daemon_lifecycle_with_a_fake_control(tmp_path):
    control = _fake_control(tmp_path)
    a = MpsDaemon("engine-a", root=str(tmp_path / "mps"), control=control)
    b = MpsDaemon("engine-b", root=str(tmp_path / "mps"), control=control)
    assert a.pipe_dir != b.pipe_dir  # two deployments on one host never share a daemon
    assert not a.status().is_running
    with pytest.raises(MpsNotRunningError, match="engine-a"):
        require_mps(a.env())
    assert a.start().is_running
    assert require_mps(a.env()) == a.pipe_dir
    assert not b.status().is_running
    a.stop()
    assert not a.status().is_running


def test_mps_rejects_bad_names():
    with pytest.raises(ConfigError):
        MpsDaemon("../etc")


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_selftest_without_gpu_reports_and_exits_zero(tmp_path, capsys):
    from bullet_ray.gpu.selftest import main

    assert main(["--out", str(tmp_path / "r.json")]) == 0
    assert "no GPU" in capsys.readouterr().out
    assert "reason" in (tmp_path / "r.json").read_text()
