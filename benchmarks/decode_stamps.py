"""Where a Gluon decode program's time goes: a copy of the kernel's module with stamps
(%globaltimer, %clock64, %smid) written at five points of every program (entry, query ready,
tile 0's scores, the tile loop's end, the stores' end; ``tokens_fp8`` also marks its copies
issued and its page ids staged, ``MARKS``), swapped into ``mla_decode`` for 8 layers a CUDA
graph (``decode_programs.py``'s shapes); per layer: the programs' start skew, each phase's
median / p90 / max (us, from %clock64 at 1.98 GHz; the marks from entry), the gap to the
layer before.
The copy is made from the tree's source at run time (the anchors below name the statements
stamped); outputs are checked bit-identical to the unstamped kernel's. ``--emit`` prints the
stamped source (compile it offline with ``gluon_offline.py``'s ``compile_sm90``).

    python3 benchmarks/decode_stamps.py --kernel tokens_fp8 --heads 16 --fp8 --shapes 64x4K
    python3 benchmarks/decode_stamps.py --kernel heads_gluon --heads 128 --shapes 64x4K,8x32K
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch
from decode_configs import paged_problem  # noqa: E402  (benchmarks/ is on sys.path)
from decode_layers import LAYERS, layer_ms
from decode_programs import SHAPES

import splash.kernels_triton as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HELPER = '''
@gluon.jit
def _stamp(ptr, slot, k: gl.constexpr):
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                  is_pure=False, pack=1)
    c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                  is_pure=False, pack=1)
    gl.store(ptr + slot * 16 + 1 + k, t)
    gl.store(ptr + slot * 16 + 8 + k, c)
    if k == 0:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                       is_pure=False, pack=1)
        gl.store(ptr + slot * 16, sm.to(gl.int64))

'''

TAIL = '''

STAMP = {"buf": None, "next": 0}


def _stamp_buffer():
    k = STAMP["next"]
    STAMP["next"] += 1
    return STAMP["buf"][k % STAMP["buf"].shape[0]]
'''

# per kernel: (file, kernel def name, slot expr, [(anchor, occurrence, k, where)], launch anchor)
KERNELS = {
    "tokens_fp8": ("mla_decode_tokens_fp8.py", "_mla_decode_fp8_tokens_kernel", "pid", [
        ("pid = gl.program_id(0)", 0, 0, "after"),
        ("qsc = gl.convert_layout(qs", 0, 1, "after"),
        ("s = warpgroup_mma_wait(0, deps=(s_tok,))", 0, 2, "after"),
        ("for i in gl.static_range(3):", 0, 3, "before"),
        ("stride_lon, L, BH, LOW_SPLITS, mma, num_warps)", 0, 4, "after"),
        ("_start_copies(None, None, kn_desc", 0, 5, "after"),
        ("_stage_pages(bt_row, stride_btp, start, end, pages", 0, 6, "after"),
    ], ("block_table, o_part, o_low, lse_part, out, lse, items,",
        "block_table, o_part, o_low, lse_part, out, lse, items, _stamp_buffer(),"),
        ("plan_ptr,  # as the tokens kernels'", "plan_ptr, stamp_ptr,")),
    "heads_gluon": ("mla_decode_heads_gluon.py", "_mla_decode_heads_gluon_kernel",
                    "pid * gl.num_programs(0) + g", [
        ("pid = gl.program_id(1)", 0, 0, "after"),
        ("mbarrier.wait(bars.index(2), 0)", 0, 1, "after"),
        ("kr_s.index(0), s),))", 0, 2, "after"),
        ("for i in gl.static_range(3):", 0, 3, "before"),
        ("gl.store(lse_ptr + pid * stride_ls + lh, lse, mask=lh < H)", 0, 4, "after"),
    ], ("block_table if items is None else items, kv,",
        "block_table if items is None else items, _stamp_buffer(), kv,"),
        ("plan_ptr,  # (programs, 4) int32: request, splits, start, end",
         "plan_ptr, stamp_ptr,")),
}


# stamps past the five phases (k 5, 6 where a kernel has them): entry to each, per program
MARKS = {"copies_issued": 5, "pages_staged": 6}


def patched_source(kind: str) -> str:
    fname, kname, slot, points, launch, sig = KERNELS[kind]
    lines = open(os.path.join(ROOT, "kernels_triton", fname)).read().split("\n")
    start = next(i for i, x in enumerate(lines) if f"def {kname}(" in x)
    out = list(lines)
    inserts = []
    for anchor, occ, k, where in points:
        hits = [i for i in range(start, len(lines)) if anchor in lines[i]]
        i = hits[occ]
        # the statement may continue on following lines: find its end by bracket balance
        j = i
        if where == "after":
            depth = lines[i].count("(") - lines[i].count(")")
            while depth > 0:
                j += 1
                depth += lines[j].count("(") - lines[j].count(")")
        indent = " " * (8 if k == 0 else 16 if k == 2 else 12)
        text = f"{indent}_stamp(stamp_ptr, {slot}, {k})"
        inserts.append((j + 1 if where == "after" else i, text))
    for pos, text in sorted(inserts, reverse=True):
        out.insert(pos, text)
    src = "\n".join(out)
    # the helper before the kernel's decorator(s)
    dec = src.index(f"def {kname}(")
    dec = src.rfind("@gluon.jit", 0, dec)
    dec = src.rfind("\n", 0, dec) + 1
    src = src[:dec] + "\n".join("    " + x if x else x for x in HELPER.split("\n")) + src[dec:]
    assert sig[0] in src, sig[0]
    src = src.replace(sig[0], sig[1], 1)
    assert launch[0] in src, launch[0]
    src = src.replace(launch[0], launch[1], 1)
    return src + TAIL


def load(kind: str):
    path = os.path.join(tempfile.mkdtemp(), f"stamped_{kind}.py")
    with open(path, "w") as f:
        f.write(patched_source(kind))
    spec = importlib.util.spec_from_file_location(f"splash.kernels_triton.stamped_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stats(buf, layers: int, programs: int) -> list[dict]:
    """Per layer: start, span, gap from the layer before, start skew and phase quantiles."""
    quantiles = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)

    def qs(v):
        return [round(float(a), 2) for a in torch.quantile(v, quantiles)]

    rows = []
    t = buf[:layers, :programs].cpu()
    base = int(t[:, :, 1][t[:, :, 1] > 0].min())
    prev_end = None
    for k in range(layers):
        x = t[k]
        live = x[:, 1] > 0
        x = x[live]
        start = float((x[:, 1] - base).min()) / 1000.0
        # a plan's padding items (no request) stamp their entry only: phases over the others
        idle = int((x[:, 12] == 0).sum())
        x = x[x[:, 12] != 0]
        g = (x[:, 1:6] - base).double() / 1000.0  # us
        c = (x[:, 8:15]).double()
        end = float(g[:, 4].max())
        cyc = 1.98e3  # %clock64 cycles an us at the H200's 1.98 GHz
        row = {"layer": k, "programs": int(live.sum()), "idle_programs": idle,
               "start_us": round(start, 2), "span_us": round(end - start, 2),
               "gap_from_prev_us": None if prev_end is None else round(start - prev_end, 2),
               "start_skew_q50_90_max": qs(g[:, 0] - start),
               "end_q50_90_max": qs(g[:, 4] - start),
               "prologue_us": qs((c[:, 1] - c[:, 0]) / cyc),
               "first_tile_us": qs((c[:, 2] - c[:, 1]) / cyc),
               "loop_us": qs((c[:, 3] - c[:, 2]) / cyc),
               "epilogue_us": qs((c[:, 4] - c[:, 3]) / cyc),
               **{f"entry_to_{name}_us": qs((c[:, k] - c[:, 0]) / cyc)
                  for name, k in MARKS.items() if bool((c[:, k] != 0).all())},
               "sms": int(torch.unique(x[:, 0]).numel())}
        prev_end = end
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="tokens_fp8", choices=list(KERNELS))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--shapes", default="64x4K")
    ap.add_argument("--out")
    ap.add_argument("--emit", action="store_true", help="write the patched source and stop")
    args = ap.parse_args()
    if args.emit:
        print(patched_source(args.kernel))
        return 0
    MD = sys.modules["splash.kernels_triton.mla_decode"]
    K.set_value_checks(False)
    dev = torch.device("cuda")
    mod = load(args.kernel)
    attr = {"tokens_fp8": "tokens_fp8", "heads_gluon": "heads_gluon"}[args.kernel]
    orig = getattr(MD, attr)
    mod.STAMP["buf"] = torch.zeros((LAYERS, 4096, 16), dtype=torch.int64, device=dev)
    result = {}
    for name, lens in SHAPES:
        if name not in args.shapes.split(","):
            continue
        run, nbytes = paged_problem(args.heads, lens, dev, args.fp8)
        setattr(MD, attr, orig)
        ref = run()[0].float()
        ms_plain = min(layer_ms(run) for _ in range(2))
        setattr(MD, attr, mod)
        got = run()[0].float()
        same = bool(torch.equal(ref, got))
        mod.STAMP["next"] = 0
        ms_stamped = min(layer_ms(run) for _ in range(2))
        # one more graph of LAYERS, stamps slot k = layer k
        mod.STAMP["buf"].zero_()
        mod.STAMP["next"] = 0
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with K.plan_scope():
                for _ in range(LAYERS):
                    run()
        torch.cuda.current_stream().wait_stream(s)
        mod.STAMP["next"] = 0
        with torch.cuda.graph(g):
            with K.plan_scope():
                for _ in range(LAYERS):
                    run()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        rows = stats(mod.STAMP["buf"], LAYERS, 4096)
        setattr(MD, attr, orig)
        result[name] = {"ms_plain": round(ms_plain, 4), "ms_stamped": round(ms_stamped, 4),
                        "bit_identical": same, "bytes": nbytes, "layers": rows}
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "layers"}))
        for r in rows:
            print("  ", json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
