"""Host time per engine step, without the model: the controller (scheduler, plans, msgspec),
the worker's step bookkeeping (StepMeta, kernel arguments) and sampling, with the model forward
replaced by zeros, so only what the host adds to every step is timed.

    python benchmarks/host_overhead.py --out benchmarks/results/cpu/host_overhead.json

On a GPU the forward of a decode step is a CUDA-graph replay; what this measures is then what
separates the step from the GPU's time (T=1, layout tp, tiny random DeepSeek-V3 checkpoint).
``--context`` sets the prompt length (block tables grow with it); ``--profile`` prints the
controller's hottest functions (cProfile) at the largest batch.

The CPU worker is a spawned process, which imports this file as its main module: the zero
forward is installed at import time, so it reaches the worker too.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch  # noqa: E402
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

import splash.engine.worker as worker_mod  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _zeros_forward(self, ids, meta, impl, switch=None):
    return torch.zeros(ids.shape[0], self.model.cfg.hidden_size, device=ids.device)


worker_mod.Worker._model_forward = _zeros_forward  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=4, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/cpu/host_overhead.json")
    args = ap.parse_args()
    from tiny_models import checkpoint

    from splash import LLM, SamplingParams

    records = []
    with LLM(checkpoint("v3"), tp_size=1, backend="cpu", layout="tp", page_size=16,
             max_num_seqs=max(args.batches)) as llm:
        for batch in args.batches:
            prompts = [[1 + (i + j) % 50 for j in range(args.context)] for i in range(batch)]
            greedy = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
            steps0 = llm.stats()["num_steps"]
            prof = cProfile.Profile() if args.profile and batch == max(args.batches) else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            llm.generate(prompts, greedy)
            if prof:
                prof.disable()
            elapsed = time.perf_counter() - t0
            steps = llm.stats()["num_steps"] - steps0
            rec = {"batch": batch, "context": args.context, "steps": steps,
                   "ms_per_step": round(elapsed / steps * 1e3, 3)}
            print(rec, flush=True)
            records.append(rec)
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    save_json(args.out, {"benchmark": "host_overhead", "records": records,
                         "notes": "model forward replaced by zeros in the worker process; "
                                  "greedy sampling; T=1 tp; steps include the prefill steps"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
