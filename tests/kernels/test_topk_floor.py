"""The split top-k's floor and compaction against torch.topk: with group maxima of any disjoint
grouping of a row's entries (consecutive groups as the indexer emits them, folded when there are
more than ``FLOOR_N``), the winners are those of the plain selection, on smooth rows, rows of
many ties, constant rows (the floor then keeps every entry), rows with a trend along the columns
(the floor loose: the last pass's exact fallback), rows with few or no finite entries; and the
indexer's group maxima are those of its scores."""

from __future__ import annotations

import pytest
import torch
from test_dsa_kernels import INDEX_CASES, _index_inputs

from splash.kernels_triton import index_scores, topk_rows, topk_rows_ref


def _rows(gen: torch.Generator, m: int) -> torch.Tensor:
    values = torch.randn(7, m, generator=gen)
    values[1] = (values[1] * 2).round() / 2  # many ties
    values[2] = 0.5  # constant: the floor is the value itself, every entry ties
    values[3, 30:] = float("-inf")  # fewer finite entries than some k
    values[4] = float("-inf")
    values[5, ::3] = float("-inf")
    values[6] += torch.linspace(0, 8, m)  # a trend: consecutive groups' maxima bound loosely
    return values


def _group_max(values: torch.Tensor, group: int) -> torch.Tensor:
    n, m = values.shape
    pad = torch.full((n, -m % group), float("-inf"))
    return torch.cat((values, pad), 1).view(n, -1, group).amax(2)


def _check(v, i, values, k):
    ref_v, ref_i = topk_rows_ref(values, k)
    torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), ref_v)
    for row, (got, want) in enumerate(zip(i.cpu().tolist(), ref_i.tolist())):
        if row != 1 and row != 2:  # tied rows: equal values, possibly other columns
            assert sorted(got) == sorted(want), row
    return ref_v


# cols: 320 where every row takes the path it takes at 600 (half the interpreter's time);
# fewer where every row still takes it (the same kernel lines, row by row) in the same launch
# variants: 192 for the first two cases, 256 for the sixth;
# 600 where fewer would change one: (8, 64, 64, 4) needs more than a chunk of survivors (else
# a plain last pass follows the floor), (24, 64, 32, 2, 1, 32) keeps the tied row on the
# exact fallback, and the last case needs more than 8 chunks for the constant row's k
# survivors a chunk to pass the narrower registers
# parts: 4 where a part of the last pass starts inside the first k columns past a row's end
# (the empty row's pads, counted as ties before the part)
@pytest.mark.parametrize("k,chunk,floor_n,group,rows,survivors,cols,parts", [
    (8, 32, 16, 8, 1, None, 192, 2), (8, 32, 16, 8, 8, None, 192, 2),
    (8, 64, 64, 4, 8, None, 600, 2), (24, 64, 32, 2, 8, None, 320, 4),
    (4, 16, 16, 16, 8, None, 320, 2),
    # the survivors searched in narrower registers first, a row a program: smooth rows fit
    # them, the tied, constant and trend rows take the chunk or the exact fallback; the last
    # case's survivors fit one chunk (the narrower search, then no second chunk)
    (8, 32, 16, 8, 1, 16, 256, 2), (24, 64, 32, 2, 1, 32, 600, 2), (4, 64, 16, 4, 1, 16, 600, 2)])
def test_floor_keeps_the_winners(device, k, chunk, floor_n, group, rows, survivors, cols,
                                 parts):
    gen = torch.Generator().manual_seed(k + chunk)
    values = _rows(gen, cols)
    cfg = {"CHUNK": chunk, "ROWS": rows, "PARTS": parts, "FLOOR_N": floor_n,
           "SURVIVOR_CHUNK": survivors}
    floor = _group_max(values, group).to(device)  # G = cols / group > FLOOR_N: folded
    v, i = topk_rows(values.to(device), k, config=cfg, floor_max=floor)
    _check(v, i, values, k)
    # ties in column order even through the floor: the constant row takes its first k columns
    assert sorted(i[2].tolist()) == list(range(k))


def test_floor_from_a_strided_grouping_and_with_slots(device):
    """Any disjoint grouping bounds: maxima of columns j, j + G, j + 2G, ...; the winners then
    become KV slots through the block table."""
    gen = torch.Generator().manual_seed(9)
    values = _rows(gen, 320)
    strided = values.view(7, 8, 40).amax(1)  # 40 groups of 8 columns, 40 apart
    cfg = {"CHUNK": 16, "ROWS": 8, "FLOOR_N": 16}
    table = torch.randperm(560, generator=gen)[:7 * 80].view(7, 80).to(torch.int32)
    v, slots = topk_rows(values.to(device), 6, config=cfg, floor_max=strided.to(device),
                         block_table=table.to(device), page_size=4)
    want = topk_rows_ref(values, 6, block_table=table, page_size=4)
    torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), want[0])
    for row in (0, 3, 4, 5, 6):
        assert sorted(slots[row].tolist()) == sorted(want[1][row].tolist())


def test_floor_max_is_checked(device):
    values = torch.zeros(2, 40, device=device)
    with pytest.raises(ValueError, match="floor_max"):
        topk_rows(values, 4, floor_max=torch.zeros(3, 5, device=device))


@pytest.mark.parametrize("case", list(INDEX_CASES))
@pytest.mark.parametrize("group", [4, 16])
def test_index_group_maxima_are_the_scores_maxima(setting, case, group):
    device = setting.device
    HI, I, PS, rows, prefix = INDEX_CASES[case]
    q, w, keys, scale, table, lens, starts, T = _index_inputs(setting, HI, I, PS, rows, prefix)
    gmax = torch.full((q.shape[0], -(-T // group)), 7.0, device=device)
    out = index_scores(q, w, keys, table, lens, starts, I ** -0.5, T, index_scale=scale,
                       group_max=gmax, group=group)
    assert torch.equal(gmax.cpu(), _group_max(out.cpu(), group))
    with pytest.raises(ValueError, match="group_max has shape"):
        index_scores(q, w, keys, table, lens, starts, I ** -0.5, T, index_scale=scale,
                     group_max=gmax[:, 1:], group=group)


def test_rows_of_more_than_64_chunks(device):
    """A pass sums at most 64 chunk counts in registers: longer rows take wider chunks."""
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(2, 16 * 64 + 100, generator=gen)
    cfg = {"CHUNK": 16, "ROWS": 2}
    v, i = topk_rows(values.to(device), 4, config=cfg)
    ref_v, ref_i = topk_rows_ref(values, 4)
    torch.testing.assert_close(v.sort(dim=1, descending=True).values.cpu(), ref_v)
    assert [sorted(r) for r in i.cpu().tolist()] == [sorted(r) for r in ref_i.tolist()]
