"""The one reader of SPLASH_* environment variables. Anything configurable from the environment
is listed here with its default, so `grep SPLASH_` finds every knob."""

from __future__ import annotations

import os

_DEFAULTS: dict[str, str] = {
    "SPLASH_LOG_LEVEL": "INFO",  # logging level of the splash logger
    "SPLASH_CALIBRATION": "",  # path of a measured hardware profile (JSON) overriding spec values
    "SPLASH_CACHE_DIR": os.path.join(os.path.expanduser("~"), ".cache", "splash"),
    "SPLASH_WORKER_TIMEOUT_S": "60",  # a step that takes longer marks the worker group dead
    "SPLASH_MASTER_PORT": "0",  # torch.distributed rendezvous port for spawned workers (0: pick)
    # torch.distributed backend override, e.g. "gloo" to run several ranks on one GPU
    # (NCCL refuses two ranks on one device)
    "SPLASH_DIST_BACKEND": "",
    # "1": pad decode steps with ghost rows as CUDA graphs do, but run them eagerly (tests the
    # padding on backends without graphs, e.g. the CPU suite)
    "SPLASH_PAD_DECODE": "",
    # tests only: "N": rank 0 raises torch.OutOfMemoryError in the forward of step N (how the
    # engine survives a worker running out of memory)
    "SPLASH_TEST_OOM_STEP": "",
    # "1": profiled steps (`LLMEngine.profile_steps`) also write torch's timeline of every
    # worker, host and device (a Chrome trace), as trace_rank<r>.json beside their summaries
    "SPLASH_PROFILE_TRACE": "",
    # "0": a layer's independent pieces (latent row / query; shared / routed experts) run in
    # order on one CUDA stream instead of two (splash/model/overlap.py)
    "SPLASH_OVERLAP": "",
    # "1": at T > 1 on NVIDIA GPUs, layer outputs up to 2 MiB are summed by a one-shot
    # all-reduce on symmetric memory instead of NCCL (splash/dist/comm.py); off until measured
    "SPLASH_FAST_ALLREDUCE": "",
    # prefill steps' MLA form (splash/layouts/expanded.py): "auto" (expanded keys and values when
    # that does fewer FLOPs than absorbed), "off" (always absorbed), or "N" (expanded for steps
    # of at least N rows on a rank)
    "SPLASH_MHA_PREFILL": "auto",
    # "0": the DSA kernels and dense decode's (its split plan, attention and lse_merge) launch
    # without programmatic dependent launch on Hopper and newer (kernels_triton/pdl.py)
    "SPLASH_PDL": "",
    "SPLASH_TOKEN": "",  # shared secret of `splash serve` and its clients (required off loopback)
}


def get(name: str) -> str:
    if name not in _DEFAULTS:
        raise KeyError(f"unknown SPLASH environment variable {name}")
    return os.environ.get(name, _DEFAULTS[name])


def get_float(name: str) -> float:
    return float(get(name))


def get_int(name: str) -> int:
    return int(get(name))
