"""Workers started by torchrun (the multi-node entry point) serve the same tokens as spawned
ones: the controller binds, each worker says hello with its rank and gets its configuration."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from splash import LLM, SamplingParams
from tiny_models import DEV, checkpoint, hf_greedy, mixed_prompts


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_torchrun_workers():
    path = checkpoint("v3")
    addr = f"tcp://127.0.0.1:{_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_port()), "-m", "splash.engine.worker_loop", "--controller", addr]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        prompts = mixed_prompts()[:3]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with LLM(path, tp_size=2, layout="dop", page_size=4, worker_addr=addr, **DEV) as llm:
            outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 4)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
