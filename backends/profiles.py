"""Hardware profiles: spec-sheet figures per accelerator, overridable by a calibration file.

Figures are per device. `link_gbps` is the per-device collective bandwidth (NVLink/xGMI bus
bandwidth an all-gather reaches), `collective_latency_us` the small-message latency of one
collective. A calibration JSON written by `splash calibrate` replaces any of these fields.

The last fields are what `splash calibrate --model DIR` fits to measured engine steps (1.0 / 0.0:
the roofline alone): the matmul and attention stages' roofline times are multiplied by
``gemm_time_scale`` and ``attention_time_scale``, every step pays ``step_overhead_us`` (host work,
launches), plus ``request_overhead_us`` per request in the step (the host's per-request work:
plans, sampling, bookkeeping), and a switch's transfer time is multiplied by
``switch_time_scale``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from splash import envs


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_bf16_tflops: float  # dense matmul peak
    peak_fp8_tflops: float  # 0 where the hardware has no fp8
    hbm_gbps: float  # device memory bandwidth
    link_gbps: float  # collective bus bandwidth per device
    collective_latency_us: float  # latency of one small collective
    memory_gib: float  # device memory
    overlap_fraction: float = 0.5  # share of communication the cost model may hide behind compute
    kernel_program_us: float = 0.0  # fixed cost of one attention program (row); interpreter only
    copy_program_us: float = 0.0  # fixed cost of one exchange/copy kernel program (row); ditto
    gemm_time_scale: float = 1.0  # measured / roofline time of the projections, MLP, LM head
    attention_time_scale: float = 1.0  # measured / roofline time of the attention kernels
    step_overhead_us: float = 0.0  # fixed cost of one engine step
    request_overhead_us: float = 0.0  # cost of one request (row group) in a step, host side
    switch_time_scale: float = 1.0  # measured / predicted transfer time of a switch
    switch_overhead_us: float = 0.0  # fixed cost of one switch (planning, installs, launches)
    source: str = "spec"  # "spec" or the calibration file it came from

    def __post_init__(self) -> None:
        for field in ("peak_bf16_tflops", "hbm_gbps", "link_gbps", "memory_gib"):
            if getattr(self, field) <= 0:
                raise ValueError(f"profile {self.name}: {field} must be positive")
        for field in ("gemm_time_scale", "attention_time_scale", "switch_time_scale"):
            if getattr(self, field) <= 0:
                raise ValueError(f"profile {self.name}: {field} must be positive")
        if min(self.step_overhead_us, self.request_overhead_us, self.collective_latency_us,
               self.switch_overhead_us) < 0:
            raise ValueError(f"profile {self.name}: overheads and latencies must be >= 0")
        if not 0.0 <= self.overlap_fraction <= 1.0:
            raise ValueError(f"profile {self.name}: overlap_fraction must lie in [0, 1]")


PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 4 (900 GB/s bidirectional).
    "h200": HardwareProfile("h200", 989.0, 1979.0, 4800.0, 360.0, 19.0, 141.0),
    # NVIDIA B200: 2.25 PFLOP/s dense bf16, 8 TB/s HBM3e, NVLink 5 (1.8 TB/s bidirectional).
    "b200": HardwareProfile("b200", 2250.0, 4500.0, 8000.0, 720.0, 15.0, 180.0),
    # Hygon BW1000 DCU (gfx936): no native fp8; figures from vendor material, calibrate on site.
    "bw1000": HardwareProfile("bw1000", 300.0, 0.0, 1800.0, 100.0, 30.0, 64.0),
    # A CPU host running kernels under the Triton interpreter: effective, not nominal, rates
    # (the interpreter streams KV at about 1 GB/s); only ratios matter (tests, demo).
    # One attention program (a request's row) costs ~50 ms per layer there, one exchange-copy
    # program ~2 ms: fitted on the 2-core CI machine (TP, DP, DOP steps of the demo model).
    "cpu": HardwareProfile("cpu", 0.2, 0.0, 1.0, 5.0, 50.0, 16.0, overlap_fraction=0.3,
                           kernel_program_us=50000.0, copy_program_us=2000.0),
}


def load_profile(name: str, calibration: str | None = None) -> HardwareProfile:
    """The named spec profile, with fields overridden by a calibration JSON when one is given
    (argument, else SPLASH_CALIBRATION)."""
    if name not in PROFILES:
        raise KeyError(f"unknown hardware profile {name!r}; known: {sorted(PROFILES)}")
    profile = PROFILES[name]
    path = calibration or envs.get("SPLASH_CALIBRATION")
    if not path:
        return profile
    if not os.path.exists(path):
        raise FileNotFoundError(f"calibration file {path} does not exist")
    with open(path) as f:
        measured = json.load(f)
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    overrides = {k: v for k, v in measured.items() if k in known and k not in ("name", "source")}
    return dataclasses.replace(profile, **overrides, source=path)
