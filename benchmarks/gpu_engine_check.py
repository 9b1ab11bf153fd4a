"""bf16 engine check on a GPU: SPLASH (bf16 weights and KV, Triton kernels) against
transformers in fp32 on the same tiny random checkpoints (DeepseekV2, DeepseekV3, GlmMoeDsa).

Greedy tokens in bf16 can legitimately leave the fp32 path where two logits are close, so the
check is teacher-forced: for every token SPLASH generated, is it fp32 transformers' argmax at
that position (top-1 agreement), and how far below the fp32 maximum is its fp32 logit (the
logit error a disagreement implies). Also reports exact greedy-sequence agreement.

    python benchmarks/gpu_engine_check.py --out benchmarks/results/h200/engine_bf16.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
from _results import save_json  # noqa: E402  (benchmarks/ is on sys.path)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def check(arch: str, kv_dtype: str | None, n_prompts: int, new_tokens: int) -> dict:
    import transformers
    from tiny_models import checkpoint, hf_greedy, mixed_prompts

    from splash import LLM, SamplingParams

    path = checkpoint(arch)
    prompts = mixed_prompts(seed=1, lengths=(1, 4, 7, 16, 37, 64, 100, 3)[:n_prompts])
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(path, tp_size=1, backend="cuda", layout="tp", dtype="bf16",
             kv_dtype=kv_dtype, page_size=16) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, params)]
    ref = hf_greedy(path, prompts, new_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    agree, total, worst_gap = 0, 0, 0.0
    for p, toks in zip(prompts, ours):
        ids = torch.tensor([p + toks], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1: len(p) - 1 + len(toks)].float()
        chosen = logits.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        gap = (logits.max(dim=1).values - chosen).max().item()
        agree += int((logits.argmax(dim=1) == torch.tensor(toks, device="cuda")).sum().item())
        total += len(toks)
        worst_gap = max(worst_gap, gap)
    return {"arch": arch, "kv_dtype": kv_dtype or "bf16", "tokens": total,
            "top1_agreement": agree / total, "max_logit_gap_fp32": worst_gap,
            "exact_sequences": sum(a == b for a, b in zip(ours, ref)), "sequences": len(ours)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/h200/engine_bf16.json")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    records = []
    for arch in ("v2", "v3", "glm"):
        for kv in (None, "fp8"):
            rec = check(arch, kv, 8, args.new_tokens)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    out = {"benchmark": "engine_bf16_vs_transformers_fp32", "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "records": records}
    save_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
