"""A history longer than the expanded budget runs in pieces (each before the chunk attended
whole, the chunk itself causally) whose partials merge by log-sum-exp: the same output as
expanding the whole history at once, for several requests, prefixes of several pieces, and a
request with no prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splash.core import mla_forms
from splash.layouts import expanded


def _attn(gen, H=2, L=16, DN=8, R=4, DV=6):
    w_uk = torch.randn(H, DN, L, generator=gen) * 0.3
    w_uv = torch.randn(H, DV, L, generator=gen) * 0.3
    cfg = SimpleNamespace(kv_lora_rank=L, qk_nope_head_dim=DN, v_head_dim=DV,
                          qk_rope_head_dim=R)

    def expand(c):
        return (torch.einsum("tl,hdl->thd", c, w_uk).contiguous(),
                torch.einsum("tl,hdl->thd", c, w_uv).contiguous())

    return SimpleNamespace(cfg=cfg, num_heads=H, w_uk=w_uk, expand=expand, sm_scale=0.3,
                           query_expanded=lambda q_in, positions: q_in)


@pytest.mark.parametrize("budget_rows", [7, 16])
def test_pieces_merge_to_the_whole_history(monkeypatch, budget_rows):
    gen = torch.Generator().manual_seed(0)
    attn = _attn(gen)
    q_lens, kv_lens = [3, 5, 2], [3, 30, 19]  # no prefix; several pieces; one or two
    k_starts = [0, 3, 33]
    rows = torch.randn(sum(kv_lens), 16 + 4, generator=gen)
    q = torch.randn(sum(q_lens), 2, 8 + 4, generator=gen)
    args = {"q_start_loc": torch.tensor([0, 3, 8, 10], dtype=torch.int32),
            "seq_lens": torch.tensor(kv_lens, dtype=torch.int32)}
    k_start = torch.tensor(k_starts, dtype=torch.int32)
    host = (q_lens, kv_lens, k_starts)
    whole = expanded.attend_rows(attn, rows, q, None, args, k_start, host, None)
    per_key = 2 * (8 + 6) + 4
    monkeypatch.setattr(expanded, "EXPANDED_BUDGET", budget_rows * per_key * 4)
    assert expanded.budget_keys(attn) == budget_rows < rows.shape[0]
    pieces = expanded.attend_rows(attn, rows, q, None, args, k_start, host, None)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_fp8_rows_are_dequantised_with_their_scales():
    """What the expanded form gathers from an fp8 cache: each row times its scale, as the
    absorbed kernels read it."""
    from splash.kernels_triton import kv_gather, quantise_rows_ref

    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(24, 20, generator=gen)
    data, scale = quantise_rows_ref(rows, torch.float8_e4m3fn)
    cache, scales = data.reshape(3, 8, 20), scale.reshape(3, 8)
    slots = torch.tensor([5, 0, 17, 23, 9])
    got = expanded.dequantised(*kv_gather(cache, slots, kv_scale=scales), torch.float32)
    want = data[slots].float() * scale[slots][:, None]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, rows[slots], atol=0.1, rtol=0.07)  # e4m3 keeps ~2 digits


def _flops_by_enumeration(cfg, q_lens, kv_lens):
    """Per head, what each form multiplies, counted pair by pair: the query rows are the last
    q of their request's k history rows and see every row up to their own."""
    L, R, DN, DV = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = expanded_ = 0
    for q, k in zip(q_lens, kv_lens):
        for row in range(k - q, k):
            seen = row + 1
            absorbed += seen * (L + R + L) + L * (DN + DV)  # scores, values; W_UK, W_UV
            expanded_ += seen * (DN + R + DV)
        expanded_ += k * L * (DN + DV)  # every history row's keys and values
    return absorbed, expanded_


@pytest.mark.parametrize("q_lens,kv_lens", [([8192], [8192]), ([512], [8704]), ([98], [8290]),
                                            ([99], [8291]), ([64], [32832]),
                                            ([2048, 1, 1], [2048, 4096, 9000]),
                                            ([2048] + [1] * 64, [2048] + [32768] * 64),
                                            ([3, 5], [3, 30])])
def test_the_cheaper_form_is_chosen(q_lens, kv_lens):
    v3 = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128)
    absorbed, expanded_ = _flops_by_enumeration(v3, q_lens, kv_lens)
    assert mla_forms.form_flops(v3, q_lens, kv_lens) == (absorbed, expanded_)
    assert mla_forms.expanded_wins(v3, q_lens, kv_lens) == (
        expanded_ < absorbed * mla_forms.EXPANDED_SPEED)


@pytest.mark.parametrize("value,want", [("", "auto"), ("auto", "auto"), (" OFF ", "off"),
                                        ("256", 256)])
def test_the_setting_is_read(monkeypatch, value, want):
    monkeypatch.setenv("SPLASH_MHA_PREFILL", value)
    assert expanded.mode() == want


@pytest.mark.parametrize("value", ["long", "0", "-3", "1.5"])
def test_a_bad_setting_names_the_choices(monkeypatch, value):
    from splash.errors import ConfigError

    monkeypatch.setenv("SPLASH_MHA_PREFILL", value)
    with pytest.raises(ConfigError, match="auto, off or a number of rows"):
        expanded.mode()


def _projecting_attn(device, dtype, H=4, L=32, DN=16, R=16, DV=16, q_dim=24):
    """An attention whose query comes from a q_in latent through q_b (as the model's does)."""
    gen = torch.Generator().manual_seed(3)
    attn = _attn(gen, H=H, L=L, DN=DN, R=R, DV=DV)
    w = {k: v.to(device, dtype) for k, v in (("w_uk", attn.w_uk), ("w_uv", torch.randn(
        H, DV, L, generator=gen) * 0.3), ("q_b", torch.randn(H, DN + R, q_dim, generator=gen)))}

    def expand(c):
        return (torch.einsum("tl,hdl->thd", c, w["w_uk"]).contiguous(),
                torch.einsum("tl,hdl->thd", c, w["w_uv"]).contiguous())

    attn.w_uk, attn.q_b, attn.expand = w["w_uk"], w["q_b"], expand
    attn.query_expanded = lambda q_in, positions: torch.einsum("nq,hdq->nhd", q_in, w["q_b"])
    return attn


def test_the_warm_up_reaches_the_pieces_and_their_merge(monkeypatch):
    """``warm_expanded`` launches what only histories past the budget launch: a non-causal
    piece, the causal chunk, and the log-sum-exp merge of the two."""
    calls = []
    real_attend, real_merge = expanded.mha_extend, expanded.lse_merge
    monkeypatch.setattr(expanded, "mha_extend", lambda *a, causal=True, **k: (
        calls.append(("attend", causal)), real_attend(*a, causal=causal, **k))[1])
    monkeypatch.setattr(expanded, "lse_merge", lambda *a, **k: (
        calls.append(("merge", None)), real_merge(*a, **k))[1])
    expanded.warm_expanded(_projecting_attn(torch.device("cpu"), torch.float32),
                           torch.device("cpu"))
    assert {("attend", False), ("attend", True), ("merge", None)} <= set(calls)
    monkeypatch.setenv("SPLASH_MHA_PREFILL", "off")
    calls.clear()
    expanded.warm_expanded(_projecting_attn(torch.device("cpu"), torch.float32),
                           torch.device("cpu"))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_after_the_warm_up_long_histories_compile_nothing():
    """On a GPU, histories cut into pieces of other sizes, several requests and row counts
    launch only binaries ``warm_expanded`` compiled (Triton's caches are the oracle)."""
    from splash.kernels_triton.compiled import compiled_binaries

    dev = torch.device("cuda")
    attn = _projecting_attn(dev, torch.bfloat16)
    expanded.warm_expanded(attn, dev)
    before = compiled_binaries()
    gen = torch.Generator(device=dev).manual_seed(0)
    q_lens, kv_lens, k_starts = [37, 130], [300, 1000], [0, 300]
    rows = torch.randn(sum(kv_lens), 32 + 16, device=dev, dtype=torch.bfloat16, generator=gen)
    q_in = torch.randn(sum(q_lens), 24, device=dev, dtype=torch.bfloat16, generator=gen)
    i32 = dict(dtype=torch.int32, device=dev)
    args = {"q_start_loc": torch.tensor([0, 37, 167], **i32),
            "seq_lens": torch.tensor(kv_lens, **i32)}
    expanded.attend_rows(attn, rows, q_in, None, args, torch.tensor(k_starts, **i32),
                         (q_lens, kv_lens, k_starts), None, budget=256)
    torch.cuda.synchronize()
    assert compiled_binaries() == before


def _step(q_lens, kv_lens, within_topk=True):
    plan = SimpleNamespace(query_lens=q_lens, context_lens=kv_lens)
    return SimpleNamespace(plan=plan, all_decode=all(q == 1 for q in q_lens),
                           within_topk=lambda topk: within_topk,
                           host_lens=lambda reqs: ([q_lens[b] for b in reqs],
                                                   [kv_lens[b] for b in reqs]))


def _v3_attn(sparse=False):
    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                          v_head_dim=128, index_topk=2048)
    return SimpleNamespace(cfg=cfg, num_heads=128, w_uk=torch.empty(0, dtype=torch.bfloat16),
                           is_sparse=sparse)


@pytest.mark.parametrize("setting,q_lens,kv_lens,want", [
    ("auto", [2048, 1, 1], [2048, 32768, 32768], [0]),  # the chunk alone: decode rows absorbed
    ("auto", [2048, 1, 40], [2048, 9000, 9040], [0]),  # a short chunk stays with the decodes
    ("auto", [2048, 512], [2048, 8704], [0, 1]),  # every row expanded: the whole step
    ("auto", [1], [1], []),  # a one-token prompt
    ("auto", [1, 1], [32768, 500], []),  # a decode step
    ("off", [2048, 1], [2048, 32768], []),
    ("4", [2048, 1], [2048, 32768], [0, 1]),  # forced: the whole step of >= 4 rows
    ("4", [2, 1], [2, 32768], [])])
def test_which_requests_run_expanded(monkeypatch, setting, q_lens, kv_lens, want):
    monkeypatch.setenv("SPLASH_MHA_PREFILL", setting)
    meta = _step(q_lens, kv_lens)
    assert expanded.expanded_requests(_v3_attn(), meta, list(range(len(q_lens)))) == want


def test_dsa_layers_that_select_stay_absorbed():
    meta = _step([2048, 1], [4096, 32768], within_topk=False)
    assert expanded.expanded_requests(_v3_attn(sparse=True), meta, [0, 1]) == []
    assert expanded.expanded_requests(_v3_attn(sparse=False), meta, [0, 1]) == [0]


def test_the_logged_crossover_is_where_the_choice_turns():
    cfg = _v3_attn().cfg
    rows = expanded.crossover_rows(cfg, history=8192)
    assert not mla_forms.expanded_wins(cfg, [rows - 1], [8192 + rows - 1])
    assert mla_forms.expanded_wins(cfg, [rows], [8192 + rows])
