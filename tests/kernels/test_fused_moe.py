"""fused_moe against its torch reference (fp32 / fp16 under the interpreter, bf16 on a GPU).

Tolerances, outputs compared in fp32 against ``fused_moe_ref`` (fp32 math on the same inputs):
- fp32: atol = rtol = 1e-5 (IEEE fp32 dots; observed ~1e-6).
- fp16: atol = rtol = 5e-3: the kernel rounds silu(gate)·up and each slot's weighted output to
  fp16 (2^-11 relative each) before the final fp16 sum; outputs are O(1).
- bf16 (DeepSeek-V2-Lite experts, N = 4096): atol = rtol = 2e-2 elementwise (the same roundings
  at 2^-8; worst element seen on H200 7.8e-3 of 8M) and a norm-relative error <= 1e-2 (seen
  3.2e-3).
"""

from __future__ import annotations

import pytest
import torch

from splash.kernels_triton import fused_moe, fused_moe_ref, moe_align

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _problem(N, E, hidden, I, k, dtype, device, seed, num_used=None):
    """Random experts scaled so gate/up/down outputs are O(1); k distinct ids per token among
    the first ``num_used`` experts. Generated on ``device`` (the GPU shapes are large)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x = randn(N, hidden).to(dtype)
    w13 = (randn(E, 2 * I, hidden) / hidden**0.5).to(dtype)
    w2 = (randn(E, hidden, I) / I**0.5).to(dtype)
    ids = torch.rand(N, num_used or E, generator=gen, device=device).argsort(-1)[:, :k]
    weights = torch.rand(N, k, generator=gen, device=device).softmax(-1)
    return x, w13, w2, weights, ids


def _check(out, ref, tol):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("N", [1, 5, 33])
def test_matches_reference(device, dtype, N):
    # experts 5..7 get no tokens: their blocks never exist, the rest are padded to BLOCK_M
    args = _problem(N, 8, 64, 32, 2, dtype, device, N, num_used=5)
    _check(fused_moe(*args), fused_moe_ref(*args), TOL[dtype])


def test_ragged_dims_and_tiles(device):
    """hidden and I not multiples of the tiles (K masks, wrapped N columns), one expert, k=1."""
    args = _problem(9, 3, 40, 24, 1, torch.float32, device, 7)
    _check(fused_moe(*args), fused_moe_ref(*args), TOL[torch.float32])
    cfg = {"BLOCK_M": 16, "BLOCK_K": 16, "gate_up": {"BLOCK_N": 16}, "down": {"BLOCK_N": 64}}
    _check(fused_moe(*args, config=cfg), fused_moe_ref(*args), TOL[torch.float32])


# the down GEMM's descriptor reads whole blocks of inter, padding slots' unwritten rows too
# (whatever memory held: the interpreter's numpy may warn); their results are never stored
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("dims", [(64, 32, 32), (40, 24, 16)], ids=["even", "ragged"])
def test_tensor_descriptor_tiles(device, dims):
    """"tma": weight tiles (and the down GEMM's sorted rows) through tensor descriptors give the
    reference's result, with K ragged against the tile and wrapped N columns too. On a GPU
    without them (before sm_90, ROCm) the launcher keeps pointer loads and must agree as well."""
    hidden, I, bk = dims
    args = _problem(13, 6, hidden, I, 2, torch.float32, device, 5, num_used=4)
    cfg = {"tma": True, "BLOCK_M": 16, "BLOCK_K": bk, "gate_up": {"BLOCK_N": 16},
           "down": {"BLOCK_N": 32}}
    _check(fused_moe(*args, config=cfg), fused_moe_ref(*args), TOL[torch.float32])


def test_tma_needs_aligned_rows(device):
    from splash.kernels_triton.fused_moe import _tma_ok

    cfg = {"tma": True}
    has_tma = device.type == "cpu" or (torch.version.hip is None
                                       and torch.cuda.get_device_capability(device) >= (9, 0))
    aligned = torch.zeros(4, 8, device=device), torch.zeros(2, 4, 8, device=device)  # 32 B rows
    assert _tma_ok(cfg, *aligned) == has_tma
    assert not _tma_ok(cfg, torch.zeros(4, 6, device=device), torch.zeros(2, 4, 6, device=device))
    assert not _tma_ok({}, *aligned)  # not asked for


def test_tiles_follow_the_batch_size(device):
    """"by_tokens" tiles apply up to their token count (decode batches), the base tiles
    beyond it; both give the reference's result."""
    from splash.kernels_triton.fused_moe import _gemm_configs

    cfg = {"BLOCK_M": 32, "BLOCK_K": 16, "gate_up": {"BLOCK_N": 32},
           "by_tokens": [[4, {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 16}}], [8, {"BLOCK_K": 32}]]}
    # the tile choice alone, over a table with no "by_tokens" (the CPU's): a GPU's own
    # per-GEMM entries would take part too
    cpu = torch.device("cpu")
    picked = {n: _gemm_configs(cfg, cpu, tokens=n)["gate_up"] for n in (None, 3, 4, 5, 9)}
    assert [(picked[n]["BLOCK_M"], picked[n]["BLOCK_N"], picked[n]["BLOCK_K"])
            for n in (None, 3, 4, 5, 9)] == [(32, 32, 16), (16, 16, 16), (16, 16, 16),
                                              (32, 32, 32), (32, 32, 16)]
    for n in (3, 5, 9):
        args = _problem(n, 6, 48, 32, 2, torch.float32, device, n)
        _check(fused_moe(*args, config=cfg), fused_moe_ref(*args), TOL[torch.float32])


def test_zero_tokens(device):
    args = _problem(0, 8, 64, 32, 2, torch.float32, device, 3)
    out = fused_moe(*args)
    assert out.shape == (0, 64) and out.dtype == torch.float32


@pytest.mark.parametrize("one_program", [False, True])
def test_align_groups_pairs_by_expert(device, one_program):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)  # pairs 0..5; expert 1 empty
    sorted_ids, block_expert = moe_align(ids, 4, 2, one_program)
    M = 6
    runs = {e: [] for e in range(4)}
    for b, e in enumerate(block_expert.tolist()):
        if e >= 0:
            runs[e] += [p for p in sorted_ids[2 * b:2 * b + 2].tolist() if p < M]
    assert {e: sorted(r) for e, r in runs.items()} == {0: [1, 4], 1: [], 2: [0, 2, 5], 3: [3]}
    assert sorted(p for p in sorted_ids.tolist() if p < M) == list(range(M))
    assert block_expert.tolist()[:4] == [0, 2, 2, 3] and set(block_expert.tolist()[4:]) <= {-1}


def _ok_args():
    x = torch.zeros(3, 16)
    return [x, torch.zeros(4, 8, 16), torch.zeros(4, 16, 4), torch.zeros(3, 2),
            torch.zeros(3, 2, dtype=torch.int64)]


@pytest.mark.parametrize(
    "index, value, message",
    [
        (0, torch.zeros(3, 16, dtype=torch.int32), "x has dtype"),
        (1, torch.zeros(4, 8, 16, dtype=torch.float16), "w_gate_up has dtype"),
        (1, torch.zeros(4, 7, 16), "2·I"),
        (1, torch.zeros(4, 8, 12), "hidden size of x"),
        (2, torch.zeros(4, 16, 5), "w_down has shape"),
        (3, torch.zeros(3, 2, dtype=torch.float16), "topk_weights has dtype"),
        (3, torch.zeros(3, 3), "topk_weights has shape"),
        (4, torch.zeros(2, 2, dtype=torch.int64), "topk_ids has shape"),
        (4, torch.full((3, 2), 4, dtype=torch.int64), "topk_ids has entries outside"),
        (4, torch.zeros(3, 2), "topk_ids has dtype"),
    ],
)
def test_rejects_bad_input(index, value, message):
    args = _ok_args()
    args[index] = value
    with pytest.raises(ValueError, match=message):
        fused_moe(*args)


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="power of two"):
        fused_moe(*_ok_args(), config={"BLOCK_K": 48})
    with pytest.raises(ValueError, match="unknown keys"):
        fused_moe(*_ok_args(), config={"BLOCK_Q": 16})
    with pytest.raises(ValueError, match="may not set BLOCK_M"):
        fused_moe(*_ok_args(), config={"down": {"BLOCK_M": 32}})


# ---------------------------------------------------------------------------------------------
# GPU tier: DeepSeek-V2-Lite routed experts (64 experts, hidden 2048, I 1408, top-6)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 3])
def test_deepseek_v2_lite_bf16(gpu_device, N):
    args = _problem(N, 64, 2048, 1408, 6, torch.bfloat16, gpu_device, 11)
    out, ref = fused_moe(*args), fused_moe_ref(*args)
    _check(out, ref, TOL[torch.bfloat16])
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
def test_replayed_from_a_cuda_graph(gpu_device):
    """A decode step of more than 64 tokens replays the prefill tiles (tensor descriptors on
    sm_90+) from a CUDA graph: the replay, on new routing, equals an eager call."""
    args = _problem(257, 64, 2048, 1408, 6, torch.bfloat16, gpu_device, 13)
    static = [a.clone() for a in args]
    fused_moe(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*static)
    fresh = _problem(257, 64, 2048, 1408, 6, torch.bfloat16, gpu_device, 14)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(*fresh))


@pytest.mark.gpu
def test_moe_layer_uses_kernel_on_cuda(gpu_device):
    """MoE.forward on CUDA (fused kernel) agrees with its torch expert loop (V2-Lite router)."""
    from splash.model.config import ModelConfig
    from splash.model.mlp import MoE, routed_experts_torch
    from splash.model.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config("deepseek-v2-lite", scale="full"))
    x, w13, w2, _, _ = _problem(257, 64, 2048, 1408, 6, torch.bfloat16, gpu_device, 5)
    router = torch.randn(64, 2048, generator=torch.Generator().manual_seed(5)).to(gpu_device)
    moe = MoE(cfg, router, None, w13, w2, shared=None)
    weights, ids = moe.route(x)
    loop = routed_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe(x).float(), loop.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("E, block_m, N, k, one_program", [
    (E, bm, N, k, one) for E, bm, N, k in [(8, 16, 50, 3), (5, 4, 7, 2), (64, 128, 33, 6),
                                           (256, 16, 1, 8)] for one in (False, True)]
    + [(64, 16, 300, 6, False), (256, 64, 2000, 8, False)])
def test_align_matches_a_stable_sort(device, E, block_m, N, k, one_program):
    """Against torch's stable sort: per expert, its block range holds exactly its pairs; runs are
    padded to block_m in expert order; blocks past the last run are -1. Both the three-kernel
    alignment (also with many programs feeding each expert's run) and the one program of
    decode-sized steps."""
    gen = torch.Generator(device=device).manual_seed(N)
    ids = torch.rand(N, E, generator=gen, device=device).argsort(-1)[:, :k]
    sorted_ids, block_expert = moe_align(ids, E, block_m, one_program)
    flat = ids.reshape(-1).cpu()
    M = flat.numel()
    blocks, got = block_expert.cpu().tolist(), sorted_ids.cpu().view(-1, block_m).tolist()
    start = 0
    for e in range(E):
        mine = (flat == e).nonzero().flatten().tolist()  # torch: this expert's pairs, in order
        n_blocks = -(-len(mine) // block_m)
        assert blocks[start:start + n_blocks] == [e] * n_blocks
        run = [p for row in got[start:start + n_blocks] for p in row]
        assert sorted(p for p in run if p < M) == mine and run.count(M) == len(run) - len(mine)
        start += n_blocks
    assert set(blocks[start:]) <= {-1} and all(p == M for row in got[start:] for p in row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_shared_output_added_in_the_final_sum(device, dtype):
    """``add``: the shared experts' output joins the slots' sum in its kernel, exactly as
    adding it afterwards (the sum rounded to x's dtype first, as torch stores it)."""
    args = _problem(5, 8, 64, 32, 2, dtype, device, 5)
    shared = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    calls = []

    def add():
        calls.append(1)
        return shared

    got = fused_moe(*args, add=add)
    assert calls == [1]
    assert torch.equal(got.cpu(), (fused_moe(*args) + shared).cpu())
    with pytest.raises(ValueError, match="add must be"):
        fused_moe(*args, add=lambda: shared[:, :32])
