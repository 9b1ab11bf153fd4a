"""Runs that need several GPUs (NCCL), one subcommand each, JSON under --out-dir:

    python benchmarks/multi_gpu.py correctness --tp 8   # 4 layouts + 12 directions == T=1 tokens
    python benchmarks/multi_gpu.py sweep --tp 8         # fixed layouts: B=16 x input, 32K x B
    python benchmarks/multi_gpu.py capacity --tp 8      # distinct KV tokens per layout at 0.85
    python benchmarks/switch_overhead.py --backend cuda --tp 8 --batch 16 --prompt-len 32768
    python benchmarks/end_to_end.py --backend cuda --tp 8 --trace rollout

The model is DeepSeek-V3-shaped (true attention and expert dimensions) with fewer layers and
experts so it fits and is written quickly; `benchmarks/multi_gpu.sh` runs everything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

CIRCUIT = ["tp", "dp", "tp", "cp", "tp", "dop", "dp", "cp", "dp", "dop", "cp", "dop", "tp"]


def build(path: str, layers: int, experts: int, preset: str = "deepseek-v3") -> str:
    """A random checkpoint of ``preset``'s full dimensions with ``layers`` layers and
    ``experts`` routed experts (O(1) activations), written once per path."""
    import transformers

    from splash.model.presets import preset_config

    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = preset_config(preset, scale="full")
        cfg.update(num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts,
                   n_group=min(cfg["n_group"], experts // 8), topk_group=1)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**cfg), dtype=torch.bfloat16)
        _unit_scale(model)
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    return path


def _unit_scale(model, seed: int = 0) -> None:
    """O(1) activations (`splash.model.presets.unit_scale`), drawn on the GPU."""
    from splash.model.presets import unit_scale

    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            x = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32)
            t.copy_(unit_scale(name, x))


def _compare(got: list[list[int]], ref: list[list[int]]) -> dict:
    """Identical requests, and the first differing position of each request that differs."""
    first = {i: next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
             for i, (g, r) in enumerate(zip(got, ref)) if g != r}
    return {"identical_requests": len(ref) - len(first), "requests": len(ref),
            "first_difference": first}


def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (batch, length), generator=g).tolist()


def correctness(args) -> dict:
    """fp32 tokens of T ranks (each layout, then the 12-direction circuit) against T=1: bf16
    near-ties on random weights make bf16 token identity meaningless. The T=1 reference runs
    with asynchronous scheduling off, the T-rank runs with it on (the default)."""
    from splash import LLM, SamplingParams

    prompts = _prompts(6, 300) + _prompts(2, 2000, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # sized to the prompts: few graph buckets and short profiling steps keep six engine
    # start-ups within one device call
    kw = {"dtype": "fp32", "enforce_eager": args.enforce_eager, "max_num_seqs": len(prompts),
          "max_model_len": 4096}
    with LLM(args.model, tp_size=1, async_scheduling=False, **kw) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    out = {"tp": args.tp, "dtype": "fp32", "reference": "T=1, synchronous scheduling",
           "layouts": {}, "switching": None}
    for layout in args.layouts.split(",") if "layouts" in args.parts else ():
        with LLM(args.model, tp_size=args.tp, layout=layout, **kw) as llm:
            got = [o.token_ids for o in llm.generate(prompts, params)]
            st = llm.stats()
        out["layouts"][layout] = {**_compare(got, ref), "graph_steps": st["graph_steps"],
                                  "steps": st["num_steps"],
                                  "steps_scheduled_ahead": st["steps_scheduled_ahead"]}
        print(layout, out["layouts"][layout], flush=True)
    if "bf16" in args.parts:
        out["bf16_teacher_forced"] = teacher_forced_top1(args, prompts)
    if "circuit" not in args.parts:
        return out
    plan = [(2 + i, d) for i, d in enumerate(CIRCUIT[1:])]
    with LLM(args.model, tp_size=args.tp, layout="tp", **kw) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, layout_plan=plan)]
        st = llm.stats()
        switches = st["switches"]
    out["switching"] = {**_compare(got, ref), "graph_steps": st["graph_steps"],
                        "steps_scheduled_ahead": st["steps_scheduled_ahead"],
                        "directions": [(s["from"], s["to"]) for s in switches],
                        "bytes_match_manifest": all(
                            s["kv_bytes_received_per_rank"] == s["predicted_kv_bytes_per_rank"]
                            for s in switches)}
    print("circuit", out["switching"], flush=True)
    return out


def teacher_forced_top1(args, prompts: list[list[int]]) -> dict:
    """bf16: T=1's greedy continuations fed back as prompts; per layout at T ranks, the share of
    positions whose top-1 next token is T=1's, over the continuations and over every position
    (free-running bf16 tokens part at the first near-tie on random weights and say little)."""
    from splash import LLM, SamplingParams

    kw = {"dtype": "bf16", "max_num_seqs": len(prompts), "max_model_len": 4096}
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def top1(llm) -> list[list[int]]:
        return [[max(lp, key=lp.get) for lp in o.prompt_logprobs[1:]]
                for o in llm.generate(seqs, score)]

    with LLM(args.model, tp_size=1, **kw) as llm:
        gen = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                   ignore_eos=True))
        seqs = [p + o.token_ids for p, o in zip(prompts, gen)]
        ref = top1(llm)
    out = {}
    for layout in ("tp", "dp", "cp", "dop"):
        with LLM(args.model, tp_size=args.tp, layout=layout, **kw) as llm:
            got = top1(llm)
        cont = [(a, b) for p, g, r in zip(prompts, got, ref)
                for a, b in zip(g[len(p) - 1:], r[len(p) - 1:])]
        every = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
        out[layout] = {"continuation_top1_agreement": sum(a == b for a, b in cont) / len(cont),
                       "all_positions_top1_agreement": sum(a == b for a, b in every) / len(every),
                       "continuation_positions": len(cont), "positions": len(every)}
        print("bf16", layout, out[layout], flush=True)
    return out


def _throughput(model: str, tp: int, layout: str, batch: int, length: int, out_len: int) -> float:
    from splash import LLM, SamplingParams

    with LLM(model, tp_size=tp, layout=layout, max_num_batched_tokens=16384) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(batch, length), SamplingParams(
            max_tokens=out_len, temperature=0.0, ignore_eos=True))
        dt = time.perf_counter() - t0
    return (batch * length + sum(len(o.token_ids) for o in outs)) / dt


def sweep(args) -> dict:
    rows = []
    points = [(16, n) for n in (1024, 4096, 16384, 65536, 131072)]
    points += [(b, 32768) for b in (1, 4, 16, 64, 128, 256)]
    for batch, length in points:
        rec = {"batch": batch, "input_len": length}
        for layout in ("tp", "dp", "cp", "dop"):
            try:
                rec[layout] = _throughput(args.model, args.tp, layout, batch, length, 32)
            except Exception as e:  # a layout that does not fit is a result, not a crash
                rec[layout] = None
                rec[f"{layout}_error"] = str(e)[:200]
        ok = {k: v for k, v in rec.items() if k in ("tp", "dp", "cp", "dop") and v}
        rec["best"] = max(ok, key=ok.get) if ok else None
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return {"tp": args.tp, "tokens_per_s": rows}


def capacity(args) -> dict:
    from splash import LLM

    with LLM(args.model, tp_size=args.tp, layout="dop", memory_fraction=0.85) as llm:
        cap = llm.stats()["kv_capacity_tokens"]
    return {"tp": args.tp, "memory_fraction": 0.85, "kv_capacity_tokens": cap,
            "dop_vs_dp_pct": 100 * (cap["dop"] / cap["dp"] - 1),
            "dop_vs_cp_pct": 100 * (cap["dop"] / cap["cp"] - 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run", choices=["correctness", "sweep", "capacity"])
    ap.add_argument("--tp", type=int, default=torch.cuda.device_count())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--parts", default="layouts,circuit,bf16",
                    help="correctness: fp32 layouts and circuit against T=1, bf16 teacher-forced "
                    "top-1 agreement")
    ap.add_argument("--layouts", default="tp,dp,cp,dop", help="correctness: the layouts part")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results/multi-gpu"))
    args = ap.parse_args()
    args.model = args.model or build(f"/tmp/splash-v3-{args.layers}l-o1", args.layers, args.experts)
    result = {"correctness": correctness, "sweep": sweep, "capacity": capacity}[args.run](args)
    result.update(run=args.run, date=datetime.date.today().isoformat(),
                  gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                  torch=torch.__version__)
    save_json(os.path.join(args.out_dir, f"{args.run}_tp{args.tp}.json"), result)
    print(json.dumps(result)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
