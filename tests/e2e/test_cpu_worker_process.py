"""The CPU backend does not depend on what the calling process imported first: its workers
run in their own processes, started with the Triton interpreter on, so a caller that imported
Triton (or torch._dynamo, as transformers does) before creating the engine gets the same tokens
as transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_models import checkpoint, hf_greedy

pytestmark = pytest.mark.timeout(300)

# one engine per group size given, one after the other in the same process (one interpreter
# and import start-up for both; each engine spawns its own workers, the environment as before)
SCRIPT = """
import json, os, sys
import triton, torch._dynamo  # imported before the engine, interpreter mode off
from splash import LLM, SamplingParams
for tp in sys.argv[2:]:
    assert "TRITON_INTERPRET" not in os.environ
    with LLM(sys.argv[1], backend="cpu", tp_size=int(tp), layout="tp") as llm:
        outs = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=4, temperature=0.0,
                                                               ignore_eos=True))
    print(json.dumps({tp: [o.token_ids for o in outs]}))
"""


def test_triton_imported_first() -> None:
    """Group sizes 1 and 2 (CPU workers get their own processes at T=1 too)."""
    path = checkpoint("v3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, path, "1", "2"], capture_output=True,
                          text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    want = hf_greedy(path, [[5, 6, 7], [9, 10]], 4)
    assert got == [{"1": want}, {"2": want}]
