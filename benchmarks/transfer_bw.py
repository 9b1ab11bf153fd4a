"""A switch's transfer against a plain collective of the same bytes, per direction.

    python benchmarks/transfer_bw.py --tp 2 --batch 16 --context 32768 \
        --out benchmarks/results/h200x2/transfer_bw_tp2.json

For each direction that moves KV or weights, the real manifest of ``batch`` requests of
``context`` tokens (DeepSeek-V3 dimensions: latent 512 + rope 64 bf16, 128 heads, ``--layers``
layers) is built by the engine's manifest builder; every rank then runs the switch's background
transfer (pack with the exchange kernels into one buffer per layer group, one all-to-all per
group and kind, unpack into the destination pages) and, in the same run, a plain
``all_to_all_single`` of the same byte counts per peer. Both are timed from issue to the last
byte in place (device synchronised), median of ``--reps``; GB/s = bytes this rank receives /
time. The switch's target is at least 80% of the plain collective.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

from splash.core.allocator import RankAllocators
from splash.core.ownership import LAYOUTS, local_page_index, page_holders
from splash.core.protocol import SwitchPlan
from splash.core.request import Request
from splash.dist.comm import Comm
from splash.engine.plans import collective_shape
from splash.kernels_triton import set_value_checks
from splash.layouts.base import KVStore
from splash.sampling_params import SamplingParams
from splash.switching.executor import PreCopy, _Group, _Transfer
from splash.switching.manifest import build_manifest

DIRECTIONS = [("tp", "dp"), ("dp", "tp"), ("tp", "cp"), ("cp", "tp"), ("tp", "dop"),
              ("dop", "dp"), ("dp", "cp"), ("cp", "dp"), ("dp", "dop"), ("dop", "cp"),
              ("cp", "dop"), ("dop", "tp")]


def manifest_for(src: str, dst: str, world: int, batch: int, context: int, page: int,
                 heads: int, pages: int):
    """Requests placed as the engine places them under ``src``; the switch's manifest."""
    lay = LAYOUTS[src]
    alloc = RankAllocators(world, pages)
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [1] * context, SamplingParams(max_tokens=1))
        req.num_computed, req.owner = context, i % world
        req.tables = [[] for _ in range(world)]
        for p in range(-(-context // page)):
            for r in page_holders(lay, p, req.owner, world):
                got = alloc[r].allocate(1)
                assert local_page_index(lay, p, world) == len(req.tables[r])
                req.tables[r].extend(got)
        reqs.append(req)
    return build_manifest(lay, LAYOUTS[dst], reqs, alloc, world, page, heads)


class _Attn:
    """Placed projection heads of one layer (the shapes of DeepSeek-V3's)."""

    def __init__(self, start: int, n: int, device, dtype, scale: int = 1) -> None:
        self.head_start, self.num_heads = start, n
        self.w = {"q_b": torch.randn(n, 192 // scale, 1536 // scale, device=device, dtype=dtype),
                  "w_uk": torch.randn(n, 128 // scale, 512 // scale, device=device, dtype=dtype),
                  "w_uv": torch.randn(n, 512 // scale, 128 // scale, device=device, dtype=dtype),
                  "w_o": torch.randn(n, 128 // scale, 7168 // scale, device=device, dtype=dtype)}

    def placed_weights(self):
        return self.w


def _time(fn, device, reps: int) -> float:
    dist.barrier()
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _phases(plan, comm, store, attns, device) -> dict:
    """One switch's transfer split into its parts (ms, device synchronised after each): row
    indices from the plan (host), packing, the collectives alone, unpacking."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    dist.barrier()
    t0 = time.perf_counter()
    xfer = _Transfer(plan, comm, store, attns, device)
    sync()
    t1 = time.perf_counter()
    groups = xfer.groups(per_layer=False)
    kv = [xfer.pack_kv(g) if plan.kv_moves else None for g in groups]
    heads = [xfer.pack_heads(g) if plan.heads_move else None for g in groups]
    sync()
    t2 = time.perf_counter()
    dist.barrier()
    t3 = time.perf_counter()
    done = []
    m = xfer.moves
    for layers, k, h in zip(groups, kv, heads):
        g = _Group(layers)
        if k is not None:
            g.kv, _ = comm.all_to_all_rows(k, m.send_counts, m.recv_counts, group=comm.xfer_group)
        if h is not None:
            g.heads, _ = comm.all_to_all_rows(h, m.w_send_counts, m.w_recv_counts,
                                              group=comm.xfer_group)
        done.append(g)
    sync()
    t4 = time.perf_counter()
    for g in done:
        xfer.unpack(g)
    sync()
    t5 = time.perf_counter()
    out.update(moves=1e3 * (t1 - t0), pack=1e3 * (t2 - t1), collectives=1e3 * (t4 - t3),
               unpack=1e3 * (t5 - t4), groups=len(groups))
    return out


EXCHANGE_CONFIGS = [(4, 256, 4), (8, 128, 4), (16, 64, 4), (32, 16, 4), (64, 16, 4),
                    (16, 16, 2), (8, 256, 8)]  # (BLOCK_M, BLOCK_W, num_warps)


def exchange_sweep(cache: torch.Tensor, rows: int, reps: int) -> list[dict]:
    """Pack and unpack of ``rows`` latent rows (as 64-bit words) with each exchange-kernel
    block shape: GB/s of row bytes read + written."""
    from splash.kernels_triton import gather_rows, scatter_rows

    pool = cache.reshape(-1, cache.shape[-1]).view(torch.uint8).view(torch.int64)
    slots = torch.randperm(pool.shape[0], device=cache.device)[:rows]
    buf = torch.empty((rows, pool.shape[1]), dtype=torch.int64, device=cache.device)
    out = []
    for bm, bw, warps in EXCHANGE_CONFIGS:
        cfg = {"BLOCK_M": bm, "BLOCK_W": bw, "num_warps": warps}
        rec = {"BLOCK_M": bm, "BLOCK_W": bw, "num_warps": warps, "row_words": pool.shape[1]}
        for name, fn in (("gather", lambda c=cfg: gather_rows(pool, slots, c, out=buf)),
                         ("scatter", lambda c=cfg: scatter_rows(pool, slots, buf, c))):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            rec[f"{name}_GBps"] = 2 * buf.numel() * 8 / dt / 1e9
        out.append(rec)
    return out


def worker(rank: int, args, port: int, q) -> None:
    cuda = args.backend == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        set_value_checks(False)  # as the engine's workers run: no host reads between kernels
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.tp)
    comm = Comm(rank, args.tp)
    dtype = torch.bfloat16 if cuda else torch.float32
    page, heads, world = args.page_size, 128, args.tp
    need_pages = args.batch * -(-args.context // page) * 2 + 64
    caches = [torch.zeros(need_pages, page, 576 // args.shrink, device=device, dtype=dtype)
              for _ in range(args.layers)]
    store = KVStore(caches, None, {})
    rows = []
    for src, dst in DIRECTIONS:
        m = manifest_for(src, dst, world, args.batch, args.context, page, heads, need_pages)
        w = m.weights[rank]
        per = heads // world
        start = 0 if src in ("dp", "cp") else rank * per
        n = heads if src in ("dp", "cp") else per
        attns = [_Attn(start, n, device, dtype, args.shrink) for _ in range(args.layers)]
        head_row = sum(t[0].numel() * t.element_size() for t in attns[0].w.values())
        plan = SwitchPlan(src, dst, w, m.kv[rank], mode="precopy", **collective_shape(
            m, caches[0].shape[-1] * caches[0].element_size(), head_row))
        got = {}

        def switch(plan=plan, attns=attns, got=got):
            pc = PreCopy(plan, comm, store, attns, device)
            pc.complete()
            got["kv"], got["w"] = pc.xfer.kv_bytes, pc.xfer.weight_bytes

        t_switch = _time(switch, device, args.reps)
        phases = _phases(plan, comm, store, attns, device)
        recv = got["kv"] + got["w"]
        if recv == 0 and not sum(len(x) for x in w.send_to):
            continue
        kv_row = caches[0].shape[-1] * caches[0].element_size() * args.layers
        send_counts = [sum(r[1::2]) * kv_row + len(h) * head_row * args.layers
                       for r, h in zip(m.kv[rank].send_runs, w.send_to)]
        recv_counts = [sum(r[1::2]) * kv_row + len(h) * head_row * args.layers
                       for r, h in zip(m.kv[rank].recv_runs, w.recv_from)]
        sbuf = torch.empty(sum(send_counts), dtype=torch.uint8, device=device)
        rbuf = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)

        def plain(rbuf=rbuf, sbuf=sbuf, recv_counts=recv_counts, send_counts=send_counts):
            dist.all_to_all_single(rbuf, sbuf, recv_counts, send_counts)

        t_plain = _time(plain, device, args.reps)
        rows.append({"from": src, "to": dst, "rank": rank, "bytes_received": recv,
                     "kv_bytes_received": got["kv"], "weight_bytes_received": got["w"],
                     "switch_ms": 1e3 * t_switch, "plain_ms": 1e3 * t_plain,
                     "phases_ms": phases,
                     "switch_GBps": recv / t_switch / 1e9 if recv else 0.0,
                     "plain_GBps": sum(recv_counts) / t_plain / 1e9 if recv else 0.0})
    if cuda and rank == 0:
        rows.append({"exchange_sweep": exchange_sweep(caches[0], args.batch * args.context // 2,
                                                      args.reps)})
    q.put(rows)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shrink", type=int, default=1, help="divide every width (CPU smoke runs)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "transfer_bw.json"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.tp)]
    for p in procs:
        p.start()
    rows = [r for _ in procs for r in q.get()]
    for p in procs:
        p.join()
    by_dir: dict = {}
    sweep = [r["exchange_sweep"] for r in rows if "exchange_sweep" in r]
    rows = [r for r in rows if "exchange_sweep" not in r]
    for r in rows:
        by_dir.setdefault((r["from"], r["to"]), []).append(r)
    summary = []
    for (src, dst), rs in by_dir.items():
        busiest = max(rs, key=lambda r: r["bytes_received"])
        summary.append({"from": src, "to": dst, "bytes_received_busiest_rank":
                        busiest["bytes_received"], "switch_GBps": busiest["switch_GBps"],
                        "plain_GBps": busiest["plain_GBps"], "phases_ms": busiest["phases_ms"],
                        "pct_of_plain": 100 * busiest["switch_GBps"] / busiest["plain_GBps"]
                        if busiest["plain_GBps"] else None})
        print(json.dumps(summary[-1]), flush=True)
    for rec in sweep[0] if sweep else []:
        print(json.dumps(rec), flush=True)
    save_json(args.out, {"rows": rows, "summary": summary, "tp": args.tp, "batch": args.batch,
                         "exchange_sweep": sweep[0] if sweep else None,
                         "context": args.context, "layers": args.layers,
                         "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                         "gpu": torch.cuda.get_device_name(0) if args.backend == "cuda"
                         else "cpu"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
