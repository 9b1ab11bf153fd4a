"""The start-up warm-up of DSA's selection kernels (``warm_selection``) launches every variant
that later steps launch: every set of constexprs and every class Triton specialises an integer
argument by (1, a multiple of 16, other), except the integers the kernels mark
``do_not_specialize``. The oracle is the set of variants that real selections record: decode
rows and prefill rows (in pieces) over histories up to the limit, several passes of the top-k,
and CP's merge of the ranks' candidates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splash.kernels_triton import dsa_index, topk, topk_split
from splash.kernels_triton.topk import topk_rows
from splash.layouts.base import KVStore
from splash.layouts.sparse import topk_indexed, warm_selection

HI, I, PS, K, MAX_LEN, PAGES = 4, 32, 16, 16, 150, 24
CONFIGS = {"index_scores": {"TILES": None, "BLOCK_T": 16},
           "topk": {"CHUNK": 32, "ROWS": 1}}  # several passes at MAX_LEN: 160 -> 80 -> 48 -> 32
# (MAX_LEN is not a whole number of pages, as max_model_len need not be: histories are scored
# in whole pages)


def _class(value: int) -> str:
    return "1" if value == 1 else "16" if value % 16 == 0 else "n"


class _Recorder:
    """Stands in for a kernel: records each launch's variant key, then launches it."""

    def __init__(self, kernel, shape_ints: list[str], seen: set) -> None:
        self.kernel, self.shape_ints, self.seen = kernel, set(shape_ints), seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            ints = tuple((name, _class(a)) for name, a in zip(self.kernel.arg_names, args)
                         if isinstance(a, int) and not isinstance(a, bool)
                         and name not in self.shape_ints)
            dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
            self.seen.add((self.kernel.__name__, tuple(sorted(kwargs.items())), ints, dtypes))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def variants(monkeypatch):
    seen: set = set()
    monkeypatch.setattr(dsa_index, "_PROGRAMS", 2)  # tiles per program grow within MAX_LEN
    monkeypatch.setattr(dsa_index, "_index_scores_kernel", _Recorder(
        dsa_index._index_scores_kernel, dsa_index.SHAPE_INTS, seen))
    for name, ints in (("_topk_place_kernel", topk_split.PLACE_INTS),
                       ("_topk_search_kernel", topk_split.SEARCH_INTS),
                       ("_topk_last_kernel", topk_split.LAST_INTS)):
        monkeypatch.setattr(topk, name, _Recorder(getattr(topk, name), ints, seen))
    return seen


def _store(gen, dev):
    keys = torch.randn((PAGES, PS, I), generator=gen).to(dev)
    # layer 0 without an indexer (a GLM-5 "shared" layer), layer 1 with one
    return KVStore([torch.zeros(PAGES, PS, 8, device=dev)] * 2, None, CONFIGS, [None, keys],
                   [None, None])


def _attn(dev):
    ix = SimpleNamespace(num_heads=HI, head_dim=I, wq_b=torch.zeros(1, device=dev), topk=K,
                         softmax_scale=I ** -0.5)
    return SimpleNamespace(indexer=ix)


def _select(store, q_lens: list[int], kv_lens: list[int], gen, pieces: bool) -> None:
    """One real selection of rows ``q_lens`` per request over histories ``kv_lens``."""
    n, B = sum(q_lens), len(q_lens)
    width = max(-(-kv // PS) for kv in kv_lens)
    table = torch.randint(0, PAGES, (B, width), generator=gen, dtype=torch.int32)
    args = {"block_table": table, "seq_lens": torch.tensor(kv_lens, dtype=torch.int32),
            "q_start_loc": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                        dtype=torch.int32)}
    if any(q != 1 for q in q_lens):  # (the engine's args also carry max_rows: not a variant)
        args["row_req"] = torch.repeat_interleave(torch.arange(B, dtype=torch.int32),
                                                  torch.tensor(q_lens))
    keys, _ = store.index_layer(1)
    args = {name: t.to(keys.device) for name, t in args.items()}
    topk_indexed(torch.randn((n, HI, I), generator=gen).to(keys.device),
                 torch.rand((n, HI), generator=gen).to(keys.device), keys, None, args,
                 I ** -0.5, K, CONFIGS,
                 lens=(q_lens, kv_lens) if pieces else None,
                 budget=2 * width * PS + 1)  # (in pieces: two rows a piece)


def test_warm_up_launches_every_variant_later_steps_launch(variants, device):
    gen = torch.Generator().manual_seed(0)
    store = _store(gen, device)
    assert warm_selection(store, [SimpleNamespace(indexer=None), _attn(device)], MAX_LEN,
                          world=2) > 0
    warmed = set(variants)
    variants.clear()
    # (decode rows at the limit: two rows record the very variants 17 did, the row count
    # specialising nothing, in an eighth of the interpreter's time; likewise two prefill rows
    # a request at the limit record what 5 + 2 did)
    for q_lens, kv_lens in [([1], [17]), ([1, 1, 1], [20, 64, 130]), ([1] * 2, [MAX_LEN] * 2),
                            ([3], [40]), ([2, 2], [MAX_LEN, 33]), ([1], [K])]:
        _select(store, q_lens, kv_lens, gen, pieces=False)
    # long prefills run in pieces (one cutting the first request, one spanning both: the
    # variants that seven rows of it in four pieces record)
    _select(store, [3, 1], [MAX_LEN, 90], gen, pieces=True)
    cands = torch.randn((3, 2 * K), generator=gen).to(device)
    topk_rows(cands, K, index=torch.zeros((3, 2 * K), dtype=torch.int32, device=device),
              config=CONFIGS["topk"])  # CP's merge of two ranks' candidates
    kernels = {v[0] for v in variants}
    assert kernels == {"_index_scores_kernel", "_topk_search_kernel", "_topk_place_kernel",
                       "_topk_last_kernel"} and len(variants) >= 6
    missing = variants - warmed
    assert not missing, f"launched after the warm-up, never warmed: {sorted(missing)}"


def test_warm_up_is_nothing_without_an_indexer_or_within_index_topk(variants, device):
    store = _store(torch.Generator().manual_seed(0), device)
    assert warm_selection(store, [SimpleNamespace(indexer=None)], MAX_LEN, world=1) == 0
    assert warm_selection(store, [_attn(device)], K, world=1) == 0
    assert not variants
