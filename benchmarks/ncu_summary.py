"""The summariser of ``benchmarks/profile_kernels.sh``'s Nsight Compute CSV exports (the
cases ``benchmarks/profile_driver.py`` runs): per case the speed-of-light, occupancy and
warp-state figures in base units, the compiler's register and spill figures, and the SASS
stall sites, into OUTDIR/summary.txt and summary.json.

    python benchmarks/profile_driver.py --summarise OUTDIR
"""

from __future__ import annotations

import csv
import glob
import json
import os
from typing import Any

# (label, [(section substring or "", metric name)]) — the first match wins
_WANTED: list[tuple[str, list[tuple[str, str]]]] = [
    ("duration", [("Speed Of Light", "Duration")]),
    ("sm_throughput_pct", [("Speed Of Light", "Compute (SM) Throughput")]),
    ("memory_throughput_pct", [("Speed Of Light", "Memory Throughput")]),
    ("dram_throughput_pct", [("Speed Of Light", "DRAM Throughput")]),
    ("dram_bytes_per_s", [("", "dram__bytes.sum.per_second"),
                          ("Memory Workload", "Memory Throughput")]),
    ("achieved_occupancy_pct", [("Occupancy", "Achieved Occupancy")]),
    ("theoretical_occupancy_pct", [("Occupancy", "Theoretical Occupancy")]),
    ("registers_per_thread", [("Launch", "Registers Per Thread")]),
    ("shared_mem_per_block", [("Launch", "Dynamic Shared Memory Per Block")]),
    ("grid_size", [("Launch", "Grid Size")]),
    ("waves_per_sm", [("Launch", "Waves Per SM")]),
    ("local_load_bytes", [("", "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum")]),
    ("local_store_bytes", [("", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum")]),
    ("tensor_pipe_pct", [
        ("", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
        ("", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ]),
    ("l2_hit_pct", [("Memory Workload", "L2 Hit Rate")]),
    ("issue_slots_busy_pct", [("Compute Workload", "Issue Slots Busy")]),
    ("warp_cycles_per_issue", [("Warp State", "Warp Cycles Per Issued Instruction")]),
]
_SCALE = {  # unit -> factor to the base unit (seconds, bytes, bytes/s)
    "nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
    "second": 1.0, "s": 1.0,
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9,
    "Tbyte/second": 1e12, "byte/s": 1.0, "Kbyte/s": 1e3, "Mbyte/s": 1e6, "Gbyte/s": 1e9,
    "Tbyte/s": 1e12, "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _read_details(path: str) -> list[dict[str, str]]:
    """Rows of an ``ncu --csv --page details`` export (lines before the header skipped)."""
    with open(path, newline="", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    return list(csv.DictReader(lines[start:]))


def summarise_csv(case: str, path: str) -> list[dict[str, Any]]:
    """One dict per profiled launch of ``path``: the wanted metrics (durations in ms, rates in
    GB/s, byte counts in bytes)."""
    launches: dict[str, dict[str, Any]] = {}
    metrics: dict[str, dict[tuple[str, str], tuple[str, str]]] = {}
    for row in _read_details(path):
        lid = row.get("ID", "?")
        if lid not in launches:
            launches[lid] = {"case": case, "launch": lid,
                             "kernel": (row.get("Kernel Name") or "")[:60],
                             "grid": row.get("Grid Size"), "block": row.get("Block Size")}
            metrics[lid] = {}
        key = (row.get("Section Name") or "", row.get("Metric Name") or "")
        metrics[lid][key] = (row.get("Metric Unit") or "", row.get("Metric Value") or "")
    out = []
    for lid, rec in launches.items():
        found = metrics[lid]
        for label, options in _WANTED:
            for section, name in options:
                hit = next(((u, v) for (s, n), (u, v) in found.items()
                            if n == name and section in s), None)
                if hit is None:
                    continue
                unit, value = hit
                num = _number(value)
                if num is None:
                    rec[label] = value
                elif label == "duration":
                    rec["duration_ms"] = round(num * _SCALE.get(unit, 1e-9) * 1e3, 4)
                elif label == "dram_bytes_per_s":
                    rec["dram_GBps"] = round(num * _SCALE.get(unit, 1.0) / 1e9, 1)
                else:
                    rec[label] = num
                break
        stalls = {n.split("issue_stalled_")[1].split("_per_issue")[0]: _number(v)
                  for (_, n), (_, v) in found.items() if "issue_stalled_" in n}
        if stalls:  # cycles each issued instruction waited, by reason, largest first
            rec["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v is not None),
                                        key=lambda kv: -kv[1]))
        out.append(rec)
    return out


def summarise(outdir: str) -> None:
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.csv"))):
        if path.endswith(".source.csv"):  # the source page: stall_sites.py's input
            continue
        case = os.path.basename(path)[: -len(".csv")]
        rows = summarise_csv(case, path)
        if not rows:
            notes.append(f"{case}: no ncu rows in {os.path.basename(path)}")
        records += rows
    for path in sorted(glob.glob(os.path.join(outdir, "*.log"))):
        case = os.path.basename(path)[: -len(".log")]
        with open(path, errors="replace") as f:
            for line in f:
                for tag in ("KERNEL_INFO", "TIMING"):
                    if line.startswith(tag + " "):
                        try:
                            records.append({"tag": tag.lower(), **json.loads(line[len(tag) + 1:])})
                        except json.JSONDecodeError:
                            pass
                if line.startswith("CASE_STATUS "):
                    notes.append(line.strip()[len("CASE_STATUS "):])
    cols = ["duration_ms", "sm_throughput_pct", "memory_throughput_pct", "dram_GBps",
            "achieved_occupancy_pct", "registers_per_thread", "local_load_bytes",
            "local_store_bytes", "tensor_pipe_pct"]
    short = ["ms", "SM%", "mem%", "DRAM GB/s", "occ%", "regs", "local ld B", "local st B",
             "tensor%"]
    lines = ["# Nsight Compute summary (one row per profiled launch)", "",
             "case | launch | kernel | grid | " + " | ".join(short)]
    for rec in records:
        if "tag" in rec:
            continue
        vals = [rec.get(c, "-") for c in cols]
        lines.append(" | ".join(str(x) for x in
                                [rec["case"], rec["launch"], rec["kernel"], rec["grid"], *vals]))
    stalled = [r for r in records if "stalls" in r]
    if stalled:
        lines += ["", "# warp stalls (cycles per issued instruction, by reason)"]
        lines += [f"{r['case']} | {r['launch']} | "
                  + ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:6])
                  for r in stalled]
    sites: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(outdir, "*.stalls.json"))):
        with open(path) as f:
            sites[os.path.basename(path)[: -len(".stalls.json")]] = json.load(f)
    if sites:  # stall_sites.py's: where the samples sit
        lines += ["", "# warp-stall samples (% of a kernel's; reasons, then opcodes)"]
        lines += [f"{c} | " + ", ".join(f"{k} {v}" for k, v in list(s.get("by_reason_pct",
                  {}).items())[:5]) + " | " + ", ".join(f"{k} {v}" for k, v in list(
                  s.get("by_opcode_pct", {}).items())[:5]) for c, s in sites.items()]
    infos = [r for r in records if r.get("tag") == "kernel_info"]
    if infos:
        lines += ["", "# compiled Triton kernels (registers, local-memory = spill bytes per "
                      "thread)"]
        for r in infos:
            lines.append(json.dumps({k: v for k, v in r.items() if k != "tag"}))
    timings = [r for r in records if r.get("tag") == "timing"]
    if timings:
        lines += ["", "# timings without ncu (CUDA-graph / eager medians, ms)"]
        lines += [json.dumps({k: v for k, v in r.items() if k != "tag"}) for r in timings]
    if notes:
        lines += ["", "# notes", *notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(outdir, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump({"records": records, "stall_sites": sites, "notes": notes}, f, indent=1)
    print(text)
