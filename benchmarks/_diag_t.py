"""Temporary: correctness of decode configs at L=512 (deleted after the run)."""
import json, sys, torch
sys.path.insert(0, "tests/kernels")
from kernel_data import block_table, paged_cache
import splash.kernels_triton as K
from triton.testing import do_bench
K.set_value_checks(False)
dev = torch.device("cuda")
CFGS = {"T": {"transposed": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        "T-ns1": {"transposed": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
        "T-maskall": {"transposed": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "mask_all_tiles": True},
        "default": {}}
for name, cfg in CFGS.items():
    for lens in ([1, 700, 2500], [640], [700], [2500]):
        gen = torch.Generator().manual_seed(3)
        n = sum(-(-x // 64) for x in lens) + 2
        kv, _ = paged_cache(n, 64, 576, torch.bfloat16, dev, gen)
        table = block_table(lens, 64, n, dev, gen)
        q = torch.randn(len(lens), 16, 576, generator=gen).bfloat16().to(dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        ref, _ = K.mla_decode_ref(q, kv, table, sl, 0.1147, 512)
        errs = []
        for splits in (1, 3, None):
            for rep in range(3):
                out, _ = K.mla_decode(q, kv, table, sl, 0.1147, 512, num_splits=splits, config=cfg)
                errs.append(round((out.float() - ref.float()).abs().max().item(), 3))
        print(name, lens, "max err (splits 1,3,auto x3):", errs, flush=True)
