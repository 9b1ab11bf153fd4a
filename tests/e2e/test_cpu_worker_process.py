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

SCRIPT = """
import json, sys
import triton, torch._dynamo  # imported before the engine, interpreter mode off
from splash import LLM, SamplingParams
with LLM(sys.argv[1], backend="cpu", tp_size=int(sys.argv[2]), layout="tp") as llm:
    outs = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=4, temperature=0.0,
                                                           ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


@pytest.mark.parametrize("tp", [1, 2])
def test_triton_imported_first(tp: int) -> None:
    path = checkpoint("v3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, path, str(tp)], capture_output=True,
                          text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == \
        hf_greedy(path, [[5, 6, 7], [9, 10]], 4)
