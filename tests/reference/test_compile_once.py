"""After start-up (its warm-up included) no Triton kernel compiles again, whatever shapes the
requests take: one page, odd page counts, mixed batches, and on a DSA model histories long
enough for several top-k passes (the warm-up saw none of these), then the longest prompt again
with its pages in the prefix cache. The oracle is Triton's own
compile caches (``compiled_binaries``); the second serving of the same shapes checks that the
count is stable."""

from __future__ import annotations

import pytest
import torch
from tiny_models import checkpoint

from splash import LLM, SamplingParams
from splash.kernels_triton.compiled import compiled_binaries

pytestmark = pytest.mark.gpu
PAGE = 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch,over,longest", [
    ("v3", {"max_position_embeddings": 1024}, 600),
    ("glm-dsa", {"index_topk": 16, "max_position_embeddings": 32768}, 17000)])
def test_no_kernel_compiles_after_start_up(arch, over, longest):
    path = checkpoint(arch, **over)
    g = torch.Generator().manual_seed(0)
    groups = [[3], [PAGE], [7 * PAGE + 3], [5, 40, 2 * PAGE + 1, 100], [longest]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, backend="cuda", page_size=PAGE, max_model_len=longest + 64) as llm:
        started = compiled_binaries()
        assert sum(started.values()) > 0  # the warm-up compiled the engine's kernels
        for lengths in groups + [None]:  # None: the last prompts again, from the prefix cache
            if lengths is not None:
                prompts = [torch.randint(10, 200, (n,), generator=g).tolist() for n in lengths]
            llm.generate(prompts, params)
            now = compiled_binaries()
            new = {k: n - started.get(k, 0) for k, n in now.items() if n != started.get(k, 0)}
            assert not new, f"compiled mid-serving for prompts of {lengths} tokens: {new}"
