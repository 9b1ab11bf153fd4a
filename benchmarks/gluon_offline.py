"""Compile the Gluon decode kernels for sm_90a on a machine without a GPU and print what
ptxas gives each (registers, spills, shared memory): the check before a device run.

Gluon's API follows Triton's version; compile with the GPU image's (3.6), installed beside
the project's own:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 .venv/bin/python benchmarks/gluon_offline.py [--sass DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type

try:
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:
    sys.exit("benchmarks/gluon_offline.py needs a Triton with Gluon (3.5 or later)")

from splash.kernels_triton import dsa_index_gluon as index_gluon
from splash.kernels_triton import mla_decode_gluon_tiles as tiles
from splash.kernels_triton import mla_decode_heads_fp8_ws as heads_fp8_ws
from splash.kernels_triton import mla_decode_heads_gluon as heads
from splash.kernels_triton import mla_decode_tokens_fp8 as tokens_fp8
from splash.kernels_triton import mla_decode_tokens_gluon as tokens

OUTS = dict(bt_ptr="*i32", o_ptr="*fp32", o_low_ptr="*bf16", lse_ptr="*fp32", out_ptr="*bf16",
            lse_out_ptr="*fp32", plan_ptr="*i32", qk_scale="fp32", scale_ptr="*fp32")


def compile_sm90(fn, types: dict, constants: dict, num_warps: int, sass: str | None,
                 name: str, maxnreg: int | None = None) -> str:
    """One kernel compiled for sm_90a; ptxas's resource line (and its SASS into ``sass``, as
    ``name``.sass)."""
    names = fn.arg_names
    signature = {n: types.get(n, "i32" if n not in constants else "constexpr") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*")}  # as the launcher finds the tensors
    src = GluonASTSource(fn, signature, {(names.index(k),): v for k, v in constants.items()},
                         aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        if sass:
            dump = subprocess.run([ptxas.replace("ptxas", "cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True, check=True).stdout
            with open(os.path.join(sass, name.replace(" ", "_") + ".sass"), "w") as f:
                f.write(dump)
    lines = [x.split(":", 1)[-1].strip() for x in info.splitlines()
             if "registers" in x or "spill" in x or "wgmma" in x]
    return f"shared {kernel.metadata.shared} B; " + "; ".join(lines)


def descriptors(q_dtype: torch.dtype, kv_dtype: torch.dtype, q_rows: int) -> dict:
    q = torch.empty(1024, 576, dtype=q_dtype)
    kv = torch.empty(1024, 576, dtype=kv_dtype)
    return {"qn_desc": mangle_type(heads.descriptor(q, 512, q_rows)),
            "qr_desc": mangle_type(heads.descriptor(q, 64, q_rows)),
            "kn_desc": mangle_type(heads.descriptor(kv, 512)),
            "kr_desc": mangle_type(heads.descriptor(kv, 64)),
            "ks_desc": mangle_type(tiles.scale_descriptor(torch.empty(16, 64)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", help="a folder for each kernel's SASS")
    ap.add_argument("--only", help="the kernels whose name holds this")
    args = ap.parse_args()
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    if tokens.gluon is None:
        sys.exit("this Triton's Gluon lacks what the kernels import")
    base = dict(L=512, R=64, PS=64, LOW_SPLITS=8)
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    heads_fn, tma_fn = heads._mla_decode_heads_gluon_kernel, tokens._mla_decode_tokens_tma_kernel
    fp8_fn = tokens._mla_decode_fp8_gluon_kernel
    runs = []
    for gather in (False, True):  # paged decode, then the sparse (gathered) form
        tag, g = " sparse" if gather else "", {**base, "GATHER": gather}
        runs += [
            (f"heads bf16{tag}", heads_fn, {**OUTS, **descriptors(bf16, bf16, 64),
                                            "kv_ptr": "*bf16"}, g, 8),
            (f"tokens bf16{tag}", tma_fn, {**OUTS, **descriptors(bf16, bf16, 16),
                                           "kv_ptr": "*bf16"}, {**g, "BH": 16}, 4),
            (f"tokens fp8{tag}", fp8_fn, {**OUTS, "q_ptr": "*fp16", "kv_ptr": "*fp8e4nv"},
             {**g, "BH": 16}, 4),
        ]
    runs.append(("tokens fp8 (e4m3 q quantised in the kernel)",
                 tokens_fp8._mla_decode_fp8_tokens_kernel,
                 {**OUTS, **descriptors(e4m3, e4m3, 16), "q_ptr": "*bf16"}, {**base, "BH": 16},
                 4))
    for gather in (False, True):
        runs.append((f"heads fp8 (widened by a worker warpgroup){' sparse' if gather else ''}",
                     heads_fp8_ws._mla_decode_heads_fp8_ws_kernel,
                     {**OUTS, **descriptors(e4m3, e4m3, heads_fp8_ws.BH), "q_ptr": "*bf16",
                      "kv_ptr": "*fp8e4nv"}, {**base, "GATHER": gather}, 8,
                     heads_fp8_ws.MAXNREG))
    keys = tiles.descriptor(torch.empty(1024, 128, dtype=e4m3), 128)
    runs.append(("DSA indexer scores (decode)", index_gluon._index_scores_gluon_kernel,
                 {"k_desc": mangle_type(keys), "ks_desc": descriptors(e4m3, e4m3, 16)["ks_desc"], "q_ptr": "*bf16",
                  "w_ptr": "*fp32", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
                  "q_start_ptr": "*i32", "out_ptr": "*fp32", "max_ptr": "*fp32",
                  "softmax_scale": "fp32"},
                 {"I": 128, "BH": 64, "PS": 64, "STAGES": 4, "GROUP": 8}, 4))
    only = [r for r in runs if args.only and args.only in r[0]]
    runs = only or runs
    for name, fn, types, constants, warps, *cap in runs:
        info = compile_sm90(fn, types, {**constants, "num_warps": warps}, warps, args.sass, name,
                            *cap)
        print(f"{name}: {info}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
