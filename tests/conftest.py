"""Suite-wide set-up: kernels run under the Triton interpreter unless a GPU test selects CUDA;
one torch thread per xdist worker (2 cores, 2 workers, spawned engine processes)."""

from __future__ import annotations

import os

import torch

if not os.environ.get("SPLASH_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
