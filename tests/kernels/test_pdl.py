"""Programmatic dependent launch: where it applies, and that a CUDA graph of PDL kernels, each
reading what the one before wrote (a DSA decode layer: the indexer's scores and group maxima,
the top-k passes with the floor, sparse MLA and its merge; then dense decode's split plan,
attention and merge), replays what eager launches compute on new inputs."""

from __future__ import annotations

import pytest
import torch

from splash.kernels_triton import index_scores, mla_decode, mla_sparse, topk_rows
from splash.kernels_triton.pdl import pdl
from splash.kernels_triton.topk import floor_group


def test_pdl_only_on_hopper_and_newer_unless_turned_off(device, monkeypatch):
    expect = (device.type == "cuda" and torch.version.hip is None
              and torch.cuda.get_device_capability(device) >= (9, 0))
    assert pdl(device) == expect
    monkeypatch.setenv("SPLASH_PDL", "0")
    assert not pdl(device)


@pytest.mark.gpu
def test_a_graph_of_pdl_kernels_replays_eager_results(gpu_device):
    dev, gen = gpu_device, torch.Generator(device=gpu_device).manual_seed(3)
    batch, context, page, k, heads = 4, 20480, 64, 2048, 16
    pages = context // page
    table = torch.randperm(batch * pages, device=dev, generator=gen).to(torch.int32)
    table = table.view(batch, pages)
    keys = torch.randn(batch * pages, page, 128, device=dev, generator=gen).to(
        torch.float8_e4m3fn)
    key_scale = torch.rand(batch * pages, page, device=dev, generator=gen) + 0.5
    kv = torch.randn(batch * pages, page, 576, device=dev, generator=gen).to(torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    group = floor_group(dev, k, context, None)
    assert group  # the floor's passes run
    gmax = torch.empty((batch, context // group), device=dev)
    iq = torch.empty(batch, 64, 128, device=dev, dtype=torch.bfloat16)
    w = torch.empty(batch, 64, device=dev)
    q = torch.empty(batch, heads, 576, device=dev, dtype=torch.bfloat16)

    def fill():
        iq.copy_(torch.randn(iq.shape, device=dev, generator=gen))
        w.copy_(torch.randn(w.shape, device=dev, generator=gen) / 8)
        q.copy_(torch.randn(q.shape, device=dev, generator=gen))

    def layer():
        scores = index_scores(iq, w, keys, table, lens, starts, 128 ** -0.5, context,
                              index_scale=key_scale, max_rows=1, group_max=gmax, group=group)
        slots = topk_rows(scores, k, block_table=table, page_size=page, floor_max=gmax)[1]
        return (slots, *mla_sparse(q, kv, slots, 0.1147, 512),
                *mla_decode(q, kv, table, lens, 0.1147, 512))

    fill()
    layer()  # compiled before the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = layer()
    for _ in range(3):
        fill()
        graph.replay()
        eager = layer()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)
