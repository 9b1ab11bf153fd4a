"""Offline generation throughput at T=1: SPLASH (decode steps from CUDA graphs, and eager)
beside transformers' `generate` on the same prompts and the same random DeepSeek-V2-Lite-shaped
weights, in the same run.

    python benchmarks/offline_throughput.py --layers 4 --batches 1 16 64 256 --out results.json

The checkpoint keeps V2-Lite's true dimensions (hidden 2048, 16 heads, kv_lora_rank 512,
64 routed experts of 1408) with fewer layers so it is written quickly; tokens/s scale with
layers for both engines alike.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)


def build_checkpoint(path: str, layers: int, dtype: torch.dtype) -> None:
    import transformers

    from splash.model.presets import preset_config

    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = preset_config("deepseek-v2-lite", scale="full")
    cfg["num_hidden_layers"] = layers
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist()


def run_splash(path: str, prompts, out_len: int, dtype: str, eager: bool = False) -> float:
    from splash import LLM, SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, layout="tp", dtype=dtype, memory_fraction=0.5,
             max_num_batched_tokens=max(8192, len(prompts) * 8), enforce_eager=eager) as llm:
        # warm-up on the same batch: compiles kernels and captures the decode graphs (a
        # one-time cost per batch bucket and block-table width, logged by the worker)
        llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        graph_steps = llm.stats()["graph_steps"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        print(f"splash eager={eager}: {llm.stats()['graph_steps'] - graph_steps} graph steps",
              flush=True)
    tokens = sum(len(o.token_ids) for o in outs)
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens / elapsed


def run_transformers(path: str, prompts, out_len: int, dtype: torch.dtype) -> float:
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], **dict(kw, max_new_tokens=2, min_new_tokens=2,
                                       attention_mask=torch.ones_like(ids[:2])))
        torch.cuda.synchronize() if dev == "cuda" else None
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize() if dev == "cuda" else None
        elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model, out, ids
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return tokens / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--ckpt", default="/tmp/splash-v2lite")
    ap.add_argument("--out", default="benchmarks/results/h200/offline_throughput.json")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    build_checkpoint(args.ckpt, args.layers, torch.bfloat16)
    vocab = json.load(open(os.path.join(args.ckpt, "config.json")))["vocab_size"]
    records = []
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_len, vocab)
        rec = {"batch": batch, "prompt_len": args.prompt_len, "out_len": args.out_len,
               "layers": args.layers, "splash_tokens_per_s": run_splash(
                   args.ckpt, prompts, args.out_len, "bf16"),
               "splash_eager_tokens_per_s": run_splash(
                   args.ckpt, prompts, args.out_len, "bf16", eager=True)}
        rec["graphs_vs_eager"] = rec["splash_tokens_per_s"] / rec["splash_eager_tokens_per_s"]
        if not args.skip_transformers:
            rec["transformers_tokens_per_s"] = run_transformers(
                args.ckpt, prompts, args.out_len, torch.bfloat16)
            rec["speedup"] = rec["splash_tokens_per_s"] / rec["transformers_tokens_per_s"]
        print(json.dumps(rec), flush=True)
        records.append(rec)
    result = {
        "benchmark": "offline_throughput", "model": "deepseek-v2-lite-shaped (random weights)",
        "date": datetime.date.today().isoformat(), "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "python": sys.version.split()[0], "records": records,
    }
    save_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
