"""Time per decode step against its bytes roofline, T=1 and T=T for every layout.

    python benchmarks/step_roofline.py --tp 2 --out benchmarks/results/h200x2/step_roofline.json

For each (tp, layout, batch, context) the engine serves ``batch`` requests whose prompts are
``context`` tokens long; once every request decodes, ``--steps`` decode steps are timed (wall
time of ``LLMEngine.step``: host work included) after ``--warmup`` steps (graph captures).
``host_ms`` is the part of a step the controller spends not waiting for the workers (schedule,
plans, update; with asynchronous scheduling, the default, most of it overlaps the device's
work on the step before). ``--sync`` measures with asynchronous scheduling off.

``roofline_ms`` = bytes the busiest rank must read in that step / the same run's copy bandwidth:
its weights (attention projections as the layout places them, its MoE shard counting only the
experts the batch's routing is expected to hit, dense MLP shards, its slice of the LM head:
greedy steps at T > 1 are drawn by every rank from its slice of the vocabulary), and the KV it
reads (every token it attends, every layer). Results before that change counted the whole LM
head on rank 0.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import sys
import time

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

from splash import LLM, SamplingParams
from splash.core.memory import MemoryModel
from splash.core.ownership import LAYOUTS, KVPlacement
from splash.model.config import ModelConfig


def copy_gbps(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    if device != "cuda":
        return 0.0
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 20 / (time.perf_counter() - t0) / 1e9


def roofline_bytes(cfg: ModelConfig, layout: str, tp: int, batch: int, context: int,
                   wdtype: str, kvdtype: str) -> int:
    """Bytes the busiest rank reads in one decode step (see the module docstring)."""
    lay = LAYOUTS[layout]
    mm = MemoryModel(cfg, tp, wdtype, kvdtype)
    wb = mm._wb
    total = mm.projection_bytes_per_rank(lay)
    c = cfg
    per_layer_repl = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
    if c.q_lora_rank:
        per_layer_repl += c.hidden_size * c.q_lora_rank
    total += per_layer_repl * c.num_hidden_layers * wb
    # rows this rank computes MLP for: all rows (MLP is tensor-parallel beneath every layout)
    for layer in range(c.num_hidden_layers):
        if c.is_moe_layer(layer):
            e, k = c.n_routed_experts, c.num_experts_per_tok
            hit = e * (1 - (1 - k / e) ** batch)  # expected distinct experts the batch routes to
            experts = hit + (c.n_shared_experts or 0)
            total += int(experts * 3 * c.hidden_size * c.moe_intermediate_size * wb / tp)
            total += c.n_routed_experts * c.hidden_size * wb  # router
        else:
            total += 3 * c.hidden_size * c.intermediate_size * wb // tp
    # LM head: greedy steps (these) are drawn by every rank from its slice of the vocabulary
    total += -(-c.vocab_size // tp) * c.hidden_size * wb
    tokens = batch * context
    if lay.kv is KVPlacement.OWNED:
        held = -(-batch // tp) * context
    elif lay.kv is KVPlacement.POSITION_SHARDED:
        held = -(-tokens // tp)
    else:
        held = tokens
    total += held * mm.kv_bytes_per_token
    return total


def kernel_profile(eng, steps: int, out: str | None = None) -> dict:
    """Where ``steps`` more decode steps spend their device time on every rank, by kernel
    (`LLMEngine.profile_steps`; kernels inside CUDA graph replays included), written to
    ``out`` (a fresh temporary directory if None)."""
    import glob
    import tempfile

    out = out or tempfile.mkdtemp(prefix="splash-profile-")
    eng.profile_steps(steps, out)
    for _ in range(steps + 3):  # the step in flight, the profiled ones, the one that stops
        eng.step()
    deadline = time.monotonic() + 30
    while len(glob.glob(os.path.join(out, "profile_rank*.json"))) < eng.world and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return {os.path.basename(f)[len("profile_"):-len(".json")]: json.load(open(f))
            for f in sorted(glob.glob(os.path.join(out, "profile_rank*.json")))}


def measure(llm: LLM, batch: int, context: int, steps: int, warmup: int,
            vocab: int, seed: int, profile_steps: int = 0, profile_dir: str | None = None,
            host_profile: str | None = None) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, min(vocab, 30000), (batch, context), generator=g).tolist()
    # long enough that every request still decodes when the last prompt is prefilled (chunked
    # prefill); the requests are aborted once the timed steps are in
    chunk = eng.scheduler.cfg.max_num_batched_tokens
    max_tokens = -(-batch * context // max(chunk, 1)) + warmup + steps + 4
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    executor, inner = eng.executor, eng.executor.collect
    worker_s: list[float] = []

    def timed(plans, while_waiting=None):
        t0 = time.perf_counter()
        out = inner(plans, while_waiting)
        worker_s.append(time.perf_counter() - t0)
        return out

    executor.collect = timed
    decode: list[tuple[float, float]] = []
    graph_before = eng.stats()["graph_steps"]
    prof = cProfile.Profile() if host_profile else None  # the controller's timed steps
    try:
        pending = set(ids)
        while pending and len(decode) < warmup + steps:
            decoding = all(r.num_computed >= r.num_tokens - 1 for r in eng.scheduler.running) \
                and len(eng.scheduler.running) == batch
            worker_s.clear()
            profiling = prof is not None and decoding and len(decode) >= warmup
            if profiling:
                prof.enable()
            t0 = time.perf_counter()
            for out in eng.step():
                if out.finished:
                    pending.discard(out.request_id)
            dt = time.perf_counter() - t0
            if profiling:
                prof.disable()
            if decoding and len(pending) == batch:
                decode.append((dt, dt - sum(worker_s)))
        profiled = kernel_profile(eng, profile_steps, profile_dir) if profile_steps and not \
            eng.scheduler.waiting and len(pending) == batch else None
    finally:
        executor.collect = inner
        for rid in pending:
            eng.abort_request(rid)
        while eng.has_unfinished():
            eng.step()
    if prof is not None and host_profile:
        os.makedirs(os.path.dirname(host_profile) or ".", exist_ok=True)
        with open(host_profile, "w") as f:
            stats = pstats.Stats(prof, stream=f)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(40)
    timed_steps = decode[warmup:warmup + steps]
    graphs = eng.stats()["graph_steps"] - graph_before
    return {"step_ms": 1e3 * statistics.median(d for d, _ in timed_steps),
            "host_ms": 1e3 * statistics.median(h for _, h in timed_steps),
            "decode_steps_timed": len(timed_steps), "graph_steps": graphs,
            **({"kernel_profile": profiled} if profiled else {})}


def summary(rows: list, skipped: list, gbps: float, model: str, cfg: ModelConfig) -> dict:
    best: dict = {}
    for r in rows:
        if "step_ms" in r and r["tp"] > 1:
            k = (r["batch"], r["context"])
            if k not in best or r["step_ms"] < best[k][0]:
                best[k] = (r["step_ms"], r["layout"])
    t1 = {(r["batch"], r["context"]): r["step_ms"] for r in rows
          if r["tp"] == 1 and "step_ms" in r}
    ratio = [{"batch": b, "context": c, "best_layout": lay, "best_tp_step_ms": v,
              "t1_step_ms": t1[(b, c)], "ratio": v / t1[(b, c)]}
             for (b, c), (v, lay) in sorted(best.items()) if (b, c) in t1]
    return {"rows": rows, "skipped": skipped, "best_layout_vs_t1": ratio,
            "copy_GBps": gbps, "model": os.path.basename(model.rstrip("/")),
            "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, default=max(torch.cuda.device_count(), 1))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--model", default=None, help="checkpoint (default: V3-shaped, 8 layers)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--max-tokens-per-point", type=int, default=600_000,
                    help="skip points whose batch x context exceeds this (prefill time)")
    ap.add_argument("--runs", default="", help="subset, e.g. '1:tp,2:dop' (default: all)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--sync", action="store_true", help="asynchronous scheduling off")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many more decode steps by kernel on every "
                    "rank (<= 3)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "step_roofline.json"))
    ap.add_argument("--host-profile", default=None,
                    help="a folder: the controller's timed decode steps under cProfile (at "
                    "T=1 on a GPU the worker runs in its process: its host work too), one "
                    "text file per point (cProfile slows the host: step times are then off)")
    ap.add_argument("--trace-dir", default=None,
                    help="with --profile-steps: keep the profiles here, timelines too")
    args = ap.parse_args()
    if args.trace_dir:
        os.environ["SPLASH_PROFILE_TRACE"] = "1"  # the workers inherit it
    if args.model is None:
        sys.path.insert(0, os.path.dirname(__file__))
        import multi_gpu

        args.model = multi_gpu.build(f"/tmp/splash-v3-{args.layers}l-o1", args.layers, args.experts)
    cfg = ModelConfig.from_hf(args.model)
    gbps = copy_gbps(args.backend)
    runs = [(1, "tp")] + [(args.tp, lay) for lay in ("tp", "dp", "cp", "dop")] if args.tp > 1 \
        else [(1, "tp")]
    if args.runs:
        runs = [(int(t), lay) for t, lay in (r.split(":") for r in args.runs.split(","))]
    points = [(b, c) for c in map(int, args.contexts.split(","))
              for b in map(int, args.batches.split(","))]
    rows, skipped = [], []
    for tp, layout in runs:
        t0 = time.perf_counter()
        with LLM(args.model, tp_size=tp, backend=args.backend, layout=layout,
                 enforce_eager=args.enforce_eager, async_scheduling=not args.sync) as llm:
            eng = llm.engine
            start_s = time.perf_counter() - t0
            for i, (batch, context) in enumerate(points):
                if batch * context > args.max_tokens_per_point:
                    skipped.append({"tp": tp, "layout": layout, "batch": batch,
                                    "context": context, "why": "prefill too long for one call"})
                    continue
                rec = {"tp": tp, "layout": layout, "batch": batch, "context": context,
                       "graphs": bool(eng.setup.cuda_graphs),
                       "async_scheduling": not args.sync,
                       "overlap": os.environ.get("SPLASH_OVERLAP") != "0"}
                try:
                    rec.update(measure(llm, batch, context, args.steps, args.warmup,
                                       cfg.vocab_size, seed=i,
                                       profile_steps=min(args.profile_steps, 3),
                                       profile_dir=args.trace_dir and os.path.join(
                                           args.trace_dir,
                                           f"tp{tp}-{layout}-b{batch}-c{context}"),
                                       host_profile=args.host_profile and os.path.join(
                                           args.host_profile,
                                           f"host_tp{tp}_{layout}_b{batch}_c{context}.txt")))
                except Exception as e:  # a point that does not fit is a result
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
                    if not eng.is_healthy():
                        break
                    continue
                wbytes = roofline_bytes(cfg, layout, tp, batch, context, eng.setup.dtype,
                                        eng.setup.kv_dtype)
                rec["bytes_busiest_rank"] = wbytes
                if gbps:
                    rec["roofline_ms"] = wbytes / (gbps * 1e9) * 1e3
                    rec["pct_roofline"] = 100 * rec["roofline_ms"] / rec["step_ms"]
                print(json.dumps(rec), flush=True)
                rows.append(rec)
            print(json.dumps({"tp": tp, "layout": layout, "start_s": start_s,
                              "total_s": time.perf_counter() - t0}), flush=True)
        save_json(args.out, summary(rows, skipped, gbps, args.model, cfg))
    result = summary(rows, skipped, gbps, args.model, cfg)
    save_json(args.out, result)
    print(json.dumps({"best_layout_vs_t1": result["best_layout_vs_t1"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
