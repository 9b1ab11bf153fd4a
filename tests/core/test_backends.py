"""Backend registry: auto-detection, profiles with calibration overrides, tuning tables."""

from __future__ import annotations

import json

import pytest
import torch

from splash.backends import PROFILES, available_backends, get_backend, load_profile
from splash.errors import ConfigError


def test_auto_picks_cpu_here_and_logs(caplog):
    caplog.set_level("INFO", logger="splash")
    backend = get_backend("auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert backend.name == expected and "cpu" in available_backends()


def test_cpu_backend_facts():
    b = get_backend("cpu")
    assert b.dist_backend == "gloo" and b.device().type == "cpu"
    assert b.fp8_dtype is None and b.kv_dtypes == (torch.float32, torch.float16)


def test_cpu_dtypes_checked() -> None:
    """bf16 is refused on CPU (the Triton interpreter computes it wrongly); the KV cache holds
    the activation dtype."""
    b = get_backend("cpu")
    assert b.check_dtypes("fp32") == ("fp32", "fp32")
    assert b.check_dtypes("float16", "fp16") == ("fp16", "fp16")
    for dtype, kv, words in (("bf16", None, "interpreter"), ("fp64", None, "unknown dtype"),
                             ("fp32", "int4", "unknown kv_dtype"), ("fp32", "fp16", "match"),
                             ("fp32", "fp8", "fp8")):
        with pytest.raises(ConfigError, match=words):
            b.check_dtypes(dtype, kv)


def test_gpu_kv_may_be_fp8() -> None:
    from splash.backends.cuda import CUDABackend

    cuda = CUDABackend.__new__(CUDABackend)
    cuda.profile_name = "h200"
    assert cuda.check_dtypes("bf16", "fp8") == ("bf16", "fp8")
    assert cuda.check_dtypes("bf16") == ("bf16", "bf16")
    with pytest.raises(ConfigError, match="match"):
        cuda.check_dtypes("bf16", "fp16")


def test_gpu_backends_describe_their_hardware():
    from splash.backends.cuda import CUDABackend
    from splash.backends.rocm import ROCmBackend

    assert CUDABackend.dist_backend == "nccl" and CUDABackend.wave_size == 32
    assert ROCmBackend.wave_size == 64
    cuda = CUDABackend.__new__(CUDABackend)
    assert cuda.fp8_dtype == torch.float8_e4m3fn
    dcu = ROCmBackend.__new__(ROCmBackend)
    dcu.profile_name = "bw1000"
    assert dcu.fp8_dtype is None  # gfx936 has no native fp8
    assert PROFILES["bw1000"].peak_fp8_tflops == 0
    assert "mla_decode" in CUDABackend.TUNING and "mla_decode" in ROCmBackend.TUNING


def test_unknown_or_unavailable_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="not available"):
            get_backend("cuda")


def test_calibration_overrides_spec(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"hbm_gbps": 4227.0, "peak_bf16_tflops": 799.0, "bogus": 1}))
    prof = load_profile("h200", str(path))
    assert prof.hbm_gbps == 4227.0 and prof.peak_bf16_tflops == 799.0
    assert prof.link_gbps == PROFILES["h200"].link_gbps and prof.source == str(path)
    with pytest.raises(FileNotFoundError):
        load_profile("h200", str(tmp_path / "missing.json"))


@pytest.mark.parametrize("hip", [None, "6.2"])
def test_launchers_read_their_devices_backend_table(monkeypatch, hip):
    """One tuning table per backend: a launcher called without a config uses the table of the
    backend that drives the device (ROCm under a HIP build of torch), and the engine's config
    (the same backend's entry) changes nothing on top of it."""
    from splash.backends import device_tuning
    from splash.backends.base import _REGISTRY
    from splash.kernels_triton.fused_moe import _gemm_configs
    from splash.kernels_triton.mla_decode import decode_config
    from splash.kernels_triton.mla_extend import extend_config

    monkeypatch.setattr(torch.version, "hip", hip)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    name = "rocm" if hip else "cuda"
    for kernel in ("mla_decode", "mla_extend", "mha_extend", "fused_moe"):
        assert device_tuning(gpu, kernel) == _REGISTRY[name].TUNING[kernel]["default"]
        assert device_tuning(cpu, kernel) == _REGISTRY["cpu"].TUNING[kernel]["default"]
    for dev, backend in ((gpu, name), (cpu, "cpu")):
        table = _REGISTRY[backend].TUNING
        for heads in (16, 128):
            for fp8 in (False, True):
                assert decode_config(heads, dev, None, fp8=fp8) == decode_config(
                    heads, dev, table["mla_decode"]["default"], fp8=fp8)
        assert extend_config(dev, None) == extend_config(dev, table["mla_extend"]["default"])
        for tokens in (None, 1, 16, 64, 4096):
            assert _gemm_configs(None, dev, tokens=tokens) == _gemm_configs(
                table["fused_moe"]["default"], dev, tokens=tokens)
    # fp16 products for fp8 KV are CUDA's choice only
    assert decode_config(16, gpu, None, fp8=True).get("fp8_fp16", False) is (hip is None)
    assert decode_config(16, cpu, None, fp8=True)["fp8_fp16"] is False


def test_sparse_attention_launches_with_its_own_entry(monkeypatch):
    """DSA's attention passes the backend's ``mla_sparse`` entry (tiles tuned for 2,048 chosen
    rows) to the launcher, not the dense decode entry."""
    import splash.layouts.base as base

    seen = {}

    def fake_sparse(*args, config=None, **kwargs):
        seen["config"] = config
        return None, None

    monkeypatch.setattr(base, "mla_sparse", fake_sparse)
    store = base.KVStore([torch.zeros(4, 4, 8)], None,
                         {"mla_decode": {"BLOCK_N": 16}, "mla_sparse": {"BLOCK_N": 32}})
    base.attend(torch.zeros(1, 2, 8), store, 0, {"decode": True}, 0.1, 4,
                slots=torch.zeros(1, 3, dtype=torch.int32))
    assert seen["config"] == {"BLOCK_N": 32}


def test_kernel_config_from_the_environment(monkeypatch):
    """SPLASH_KERNEL_CONFIG lays its entries over the tuning table's; a malformed value is a
    clear error naming the variable."""
    cpu = get_backend("cpu")
    base = cpu.kernel_config("mla_decode")
    monkeypatch.setenv("SPLASH_KERNEL_CONFIG", json.dumps({"mla_decode": {"BLOCK_N": 32},
                                                           "topk": {"PARTS": 4}}))
    assert cpu.kernel_config("mla_decode") == {**base, "BLOCK_N": 32}
    assert cpu.kernel_config("topk") == {"PARTS": 4}
    for bad in ("{not json", '["topk"]', '{"topk": 4}'):
        monkeypatch.setenv("SPLASH_KERNEL_CONFIG", bad)
        with pytest.raises(ConfigError, match="SPLASH_KERNEL_CONFIG"):
            cpu.kernel_config("topk")
