"""Rounds of topk_rows' two threshold searches (bisection; false position, ``SECANT``) per chunk,
counted by a numpy model of the kernels' loops (CPU only): the rounds, not the time, since each
round is one compare-and-count over the chunk and one block-wide sum. Chunks of 8,192 entries,
k = 2,048, for each pass of a 128K row (pass 1: the row's chunks; pass 2 and 3: chunks of the
winners of the pass before), on four score shapes.

    python3 benchmarks/topk_rounds.py --out benchmarks/results/cpu/topk_rounds.json
"""

from __future__ import annotations

import argparse

import numpy as np
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

K, CHUNK, WIDTH = 2048, 8192, 131072


def _keys(v: np.ndarray) -> np.ndarray:
    """fp32 -> the kernels' uint32 order keys (as int64; -inf -> 0)."""
    b = v.astype(np.float32).view(np.int32).astype(np.int64)
    k = np.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return np.where(v > -np.inf, k, -2**31) + 2**31


def _value(key: int) -> float:
    k = key - 2**31
    bits = k if k >= 0 else k ^ 0x7FFFFFFF
    return float(np.array([bits], dtype=np.int64).astype(np.int32).view(np.float32)[0])


def bisection(u: np.ndarray) -> int:
    if (u > 0).sum() <= K:
        return 0
    prefix = 0
    for r in range(32):
        cand = prefix | (1 << (31 - r))
        count = int((u >= cand).sum())
        if count >= K:
            prefix = cand
            if count == K:
                return r + 1
    return 32


def false_position(u: np.ndarray, rounds: int = 16) -> int:
    """_kth_largest_secant's loops: Illinois false position on the values for ``rounds``
    rounds, then a bisection of the bracket's keys."""
    n = int((u > 0).sum())
    if n <= K:
        return 0
    lo, hi = int(u[u > 0].min()), int(u.max())
    f_lo, f_hi, side, r = float(n - K), float(-K), 0, 0
    while lo < hi:
        if r < rounds:
            frac = f_lo / max(f_lo - f_hi, 1.0)
            v = np.float32(_value(lo) * (1 - frac) + _value(hi) * frac)
            cand = min(max(int(_keys(np.array([v]))[0]), lo + 1), hi)
        else:
            cand = lo + (hi - lo + 1) // 2
        count = int((u >= cand).sum())
        r += 1
        if count >= K:
            lo, f_lo = cand, float(count - K)
            f_hi *= 0.5 if side > 0 else 1.0
            side = 1
            if count == K:
                break
        else:
            hi, f_hi = cand - 1, float(count - K)
            f_lo *= 0.5 if side < 0 else 1.0
            side = -1
    return r


def _rows(kind: str, rng: np.random.Generator, rows: int) -> np.ndarray:
    if kind == "indexer":  # a signed mix of 64 heads' relu(q . k), as the indexer sums
        w = rng.standard_normal(64) / 8
        return np.stack([np.maximum(rng.standard_normal((WIDTH, 64)), 0) @ w
                         for _ in range(rows)])
    x = rng.standard_normal((rows, WIDTH))
    if kind == "relu":
        return np.maximum(x, 0) * 3 + rng.random((rows, WIDTH))
    if kind == "tied":  # quarter steps: many equal values at the threshold
        return np.round(x * 4) / 4
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/cpu/topk_rounds.json")
    ap.add_argument("--rows", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result = []
    for kind in ("indexer", "normal", "relu", "tied"):
        row_set = _rows(kind, rng, args.rows).astype(np.float32)
        passes: list[list[np.ndarray]] = [[c for r in row_set for c in r.reshape(-1, CHUNK)]]
        while len(passes[-1]) > len(row_set):  # each chunk's winners, then chunks of those
            won = [np.sort(c)[-K:] for c in passes[-1]]
            per_row = len(won) // len(row_set)
            passes.append([c for i in range(len(row_set))
                           for c in np.concatenate(won[i * per_row:(i + 1) * per_row])
                           .reshape(-1, CHUNK)])
        for p, chunks in enumerate(passes, 1):
            keys = [_keys(c) for c in chunks]
            row = {"scores": kind, "pass": p, "chunks": len(chunks),
                   "bisection": round(float(np.mean([bisection(u) for u in keys])), 2),
                   "false_position": round(float(np.mean([false_position(u) for u in keys])), 2)}
            result.append(row)
            print(row, flush=True)
    save_json(args.out, {"benchmark": "topk_rounds", "k": K, "chunk": CHUNK, "width": WIDTH,
                         "rows": result})


if __name__ == "__main__":
    main()
