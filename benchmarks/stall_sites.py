"""Where a kernel's warps wait, from an Nsight Compute source-page export: the warp-stall samples
by reason, by SASS opcode, and the instructions that hold the most.

    ncu ... --section SourceCounters -o CASE python3 benchmarks/profile_driver.py CASE
    ncu --import CASE.ncu-rep --page source --csv --print-source sass > CASE.source.csv
    python3 benchmarks/stall_sites.py CASE.source.csv [--top 25] [--out CASE.stalls.json]

(``benchmarks/profile_kernels.sh`` runs all three for every case.) The export holds one row a
SASS instruction: its text, its samples (all, and by reason: ``stall_long_sb``, ``stall_wait``
...). Percentages are of all the kernel's samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(sass: str) -> str:
    """``@!P1 BRA 0x..`` -> ``BRA``; ``QGMMA.64x16x32.F32 ...`` -> ``QGMMA``."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def read_rows(path: str) -> list[dict[str, str]]:
    """The instruction rows of a source-page CSV (the lines before its header skipped)."""
    with open(path, newline="", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit(f"{path}: no source-page header (export with --page source --csv)")
    return list(csv.DictReader(lines[start:]))


def summarise(rows: list[dict[str, str]], top: int = 25) -> dict[str, Any]:
    """Samples in all, by reason and by opcode (percent, largest first) and the ``top``
    instructions (offset, text, percent, the reasons holding at least a tenth of its samples)."""
    if not rows:
        return {"total": 0}
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_number(r.get(SAMPLES, "")) for r in rows)
    if total <= 0:
        return {"total": 0}
    by_reason: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    for r in rows:
        for k in reasons:
            by_reason[k.removeprefix("stall_")] += _number(r[k])
        by_op[_opcode(r.get("Source", "").strip())] += _number(r.get(SAMPLES, ""))

    def pct(v: float) -> float:
        return round(100 * v / total, 2)

    sites = sorted(rows, key=lambda r: -_number(r.get(SAMPLES, "")))[:top]
    return {
        "total": int(total),
        "by_reason_pct": {k: pct(v) for k, v in by_reason.most_common() if v},
        "by_opcode_pct": {k: pct(v) for k, v in by_op.most_common(20) if v},
        "top_instructions": [
            {"offset": hex(int(r["Address"], 16) & 0xFFFF) if r["Address"].startswith("0x")
             else r["Address"], "sass": r.get("Source", "").strip(),
             "pct": pct(_number(r.get(SAMPLES, ""))),
             "reasons": {k.removeprefix("stall_"): int(_number(r[k])) for k in reasons
                         if _number(r[k]) >= 0.1 * _number(r.get(SAMPLES, ""))}}
            for r in sites],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass export")
    ap.add_argument("--top", type=int, default=25, help="instructions listed")
    ap.add_argument("--out", help="write the summary here as JSON")
    args = ap.parse_args()
    out = summarise(read_rows(args.csv), args.top)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "top_instructions"}, indent=1))
    for site in out.get("top_instructions", [])[:10]:
        print(f"{site['pct']:6.2f}%  {site['offset']:>7}  {site['sass'][:64]}  {site['reasons']}")


if __name__ == "__main__":
    main()
