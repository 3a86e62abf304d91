"""The "green" SM-partition backend: green contexts made by native/libsmctl, one torch stream per side."""

from __future__ import annotations

import logging
from typing import Any

from bullet_ray.errors import ConfigError
from bullet_ray.gpu import smctl
from bullet_ray.gpu.partition import LadderEntry, SideName, SmPartitioner, check_ladder, default_ladder

logger = logging.getLogger(__name__)

_MASKS = {"decode": smctl.SIDE_DECODE, "prefill": smctl.SIDE_PREFILL, "both": smctl.SIDE_BOTH}


class GreenPartitioner(SmPartitioner):
    """Complementary green-context splits; this process makes the streams of its side(s) only.
    Decode streams get the higher CUDA priority (it is latency-bound). The driver rounds each decode
    count up to its granularity (8 SMs on an H100): `ladder` holds the SMs granted."""

    name = "green"
    is_switchable = True

    def __init__(self, side: SideName, device: int = 0, decode_sm_counts: list[int] | None = None,
                 decode_priority: int = -1, prefill_priority: int = 0) -> None:
        import torch

        caps = smctl.capabilities(device)
        super().__init__(side, caps)
        if not caps.green_ctx_supported:
            raise smctl.NotSupportedError(caps.reason or "green contexts unsupported")
        counts = list(decode_sm_counts) if decode_sm_counts is not None else default_ladder(caps.sm_count,
                                                                                             caps.granularity)
        check_ladder(counts, caps.sm_count)
        torch.cuda.init()
        torch.cuda.set_device(device)  # the primary context current on this thread (green contexts need one)
        self.native = smctl.NativeLadder(device, counts, _MASKS[side], decode_priority, prefill_priority)
        self.ladder = [LadderEntry(i, e.decode_sms, e.prefill_sms) for i, e in enumerate(self.native.entries)]
        granted = [e.decode_sms for e in self.ladder]
        if any(b <= a for a, b in zip(granted, granted[1:])):  # e.g. [10, 12] both rounded up to 16 on Hopper
            self.native.close()
            raise ConfigError("decode_sm_counts", f"decode SM counts {counts} round up to {granted} (groups of "
                              f"{caps.granularity} SMs): two entries would be one split, give distinct groups")
        starved = [e for e in self.ladder if e.prefill_sms < 1]
        if starved:
            self.native.close()
            raise ConfigError("decode_sm_counts", f"decode SM count(s) {[counts[e.index] for e in starved]} round up "
                              f"to the whole GPU ({caps.sm_count} SMs, groups of {caps.granularity}): "
                              "leave SMs for prefill")
        dev = torch.device("cuda", device)
        self._streams: dict[tuple[int, str], Any] = {}
        for i, e in enumerate(self.native.entries):
            if e.decode_stream:
                self._streams[(i, "decode")] = torch.cuda.ExternalStream(e.decode_stream, device=dev)
            if e.prefill_stream:
                self._streams[(i, "prefill")] = torch.cuda.ExternalStream(e.prefill_stream, device=dev)
        logger.info("green partitions on device %d (%s side): %s", device, side,
                    [(e.decode_sms, e.prefill_sms) for e in self.ladder])

    def _add_whole_gpu_streams(self, index: int) -> None:
        """Decode's stream on the whole GPU: an ordinary stream of the primary context (every SM), at
        decode's priority; prefill has none there (it must not launch on that entry)."""
        import torch

        if self.side in ("decode", "both"):
            self._streams[(index, "decode")] = torch.cuda.Stream(device=torch.cuda.current_device(), priority=-1)

    def stream(self, index: int, side: str) -> Any:
        self._check_index(index)
        self._check_stream_side(side)
        stream = self._streams.get((index, side))
        if stream is None:
            raise ConfigError("split_index", f"the {side} side has no SMs on ladder entry {index}")
        return stream

    def close(self) -> None:
        if self._streams:
            import torch

            torch.cuda.synchronize()
        self._streams.clear()
        self.native.close()
