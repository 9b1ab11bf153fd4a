"""`splash plan`: the ownership model and the cost model for one deployment, without a model run.

For a preset or checkpoint, a hardware profile and T ranks: per-layer projection and KV sizes,
per layout the per-rank memory for ``batch`` requests of ``input_len`` tokens, KV capacity,
predicted decode step time and feasibility, the chosen layout, and the bytes every switch
direction moves (docs/switching.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splash.backends.profiles import PROFILES, HardwareProfile, load_profile
from splash.core.ownership import LAYOUT_NAMES, fitting_layouts, get_layout
from splash.errors import ConfigError
from splash.model.config import ModelConfig
from splash.model.presets import preset_config
from splash.planning.cost_model import BatchShape
from splash.planning.regimes import decode_tok_s, max_resident
from splash.planning.simulator import SimConfig, build_models

MIB = 1 << 20
GIB = 1 << 30


def resolve_model(model) -> tuple[object, str]:
    """(ModelConfig, name) from a preset name, a checkpoint dir / config.json, or a config."""
    if not isinstance(model, (str, Path)):
        return model, getattr(model, "model_type", "model")
    path = Path(model)
    if path.is_dir() or path.suffix == ".json":
        return ModelConfig.from_hf(path), path.name
    try:
        return ModelConfig.from_hf(preset_config(str(model), scale="full")), str(model)
    except (KeyError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{model!r} is neither a checkpoint directory nor a preset ({e})") \
            from None


def resolve_hardware(hardware, calibration: str | None = None) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware not in PROFILES:
        raise ConfigError(f"unknown hardware {hardware!r}; choose from {sorted(PROFILES)}")
    return load_profile(hardware, calibration)


def plan(cfg, hardware, tp: int, batch: int = 16, input_len: int = 4096,
         memory_fraction: float = 0.85, kv_dtype: str = "bf16", weight_dtype: str = "bf16",
         calibration: str | None = None, page_size: int = 64,
         max_num_batched_tokens: int = 8192, reserve_bytes: int | None = None,
         suggest: bool = True) -> dict:
    """The plan as a JSON-serialisable dict (see module docstring). When no layout holds even
    one request, ``chosen`` is None and ``reason`` says why and (``suggest``) what would fit."""
    if tp < 1 or batch < 1 or input_len < 1:
        raise ConfigError("tp, batch and input_len must be >= 1")
    cfg, name = resolve_model(cfg)
    profile = resolve_hardware(hardware, calibration)
    sim = SimConfig(max_num_batched_tokens=max_num_batched_tokens, memory_fraction=memory_fraction,
                    page_size=page_size, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                    reserve_bytes=reserve_bytes)
    cm, policy = build_models(cfg, profile, tp, sim)
    mem, feas = cm.memory, policy.feasibility
    fit = fitting_layouts(cfg.num_attention_heads, tp)
    shape = BatchShape.decode(batch, input_len)
    tokens = [input_len] * batch
    layouts, tok_s = {}, {}
    for lay in LAYOUT_NAMES:
        resident = max_resident(policy, lay, input_len, batch) if lay in fit else 0
        bd = cm.breakdown(lay, shape)
        layouts[lay] = {
            "fits_heads": lay in fit,
            "static_bytes": mem.static_bytes_per_rank(get_layout(lay)),
            "per_rank_bytes": feas.per_rank_bytes(lay, tokens),
            "kv_capacity_tokens": feas.kv_capacity_tokens(lay, policy.budget_bytes),
            "max_resident_requests": resident,
            "feasible": lay in fit and feas.feasible(lay, tokens, policy.budget_bytes),
            "step_time_ms": round(bd["total"], 4),
            "breakdown_ms": {k: round(v, 4) for k, v in bd.items()},
        }
        tok_s[lay] = decode_tok_s(cm, lay, batch, input_len, resident) if lay in fit else 0.0
        layouts[lay]["decode_tok_s"] = round(tok_s[lay], 1)
    best = max(tok_s, key=lambda n: tok_s[n])
    chosen = best if tok_s[best] > 0 else None  # None: not one request fits anywhere
    switches = {}
    for src in fit:
        for dst in fit:
            if src != dst:
                sc = cm.switch_cost(src, dst, shape)
                switches[f"{src}->{dst}"] = {
                    "primitives": list(sc.primitives) or ["discard"],
                    "weight_bytes_per_rank_per_layer": sc.weight_bytes_per_rank_per_layer,
                    "kv_bytes_per_rank_per_layer": sc.kv_bytes_per_rank_per_layer,
                    "transfer_ms_per_layer": round(sc.transfer_ms_per_layer, 4),
                    "live_ms": round(sc.live_ms, 3), "blocking_ms": round(sc.blocking_ms, 3),
                    "headroom_ok": feas.switch_feasible(src, dst, tokens, policy.budget_bytes)}
    return {
        "model": name, "hardware": profile.name, "profile_source": profile.source, "tp": tp,
        "batch": batch, "input_len": input_len, "memory_fraction": memory_fraction,
        "weight_dtype": weight_dtype, "kv_dtype": kv_dtype,
        "budget_bytes_per_rank": policy.budget_bytes, "reserve_bytes_per_rank": feas.reserve_bytes,
        "projection_bytes_per_layer": mem.projection_bytes_per_layer,
        "projection_mib_per_layer": round(mem.projection_bytes_per_layer / MIB, 2),
        "weight_allgather_bytes_per_rank_per_layer": mem.weight_allgather_bytes_per_rank_per_layer,
        "weight_allgather_mib_per_rank_per_layer":
            round(mem.weight_allgather_bytes_per_rank_per_layer / MIB, 2),
        "kv_bytes_per_token_per_layer": mem.kv_bytes_per_token_per_layer,
        "aux_kv_bytes_per_token_per_layer": feas.aux_kv_bytes_per_token_per_layer,
        "common_bytes_per_rank": mem.common_bytes_per_rank,
        "layouts": layouts, "chosen": chosen,
        "reason": (f"{best}: {tok_s[best]:.0f} decode tok/s for {batch} x {input_len} "
                   f"(resident {layouts[best]['max_resident_requests']})" if chosen else
                   _why_nothing_fits(layouts, fit, policy.budget_bytes, input_len) +
                   (_what_fits(dict(cfg=cfg, hardware=profile, tp=tp, batch=batch,
                                    input_len=input_len, memory_fraction=memory_fraction,
                                    kv_dtype=kv_dtype, weight_dtype=weight_dtype,
                                    page_size=page_size,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    reserve_bytes=reserve_bytes)) if suggest else "")),
        "switches": switches,
    }


def _why_nothing_fits(layouts: dict, fit: list[str], budget: int, input_len: int) -> str:
    best = min(fit, key=lambda n: layouts[n]["static_bytes"])
    static = layouts[best]["static_bytes"]
    if static >= budget:
        return (f"no layout fits: weights and fixed buffers alone take {static / GIB:.1f} GiB "
                f"per rank even in {best}, over the {budget / GIB:.1f} GiB budget")
    room = max(layouts[n]["kv_capacity_tokens"] for n in fit)
    return (f"no layout fits: the KV room left after the weights holds {room:,} tokens, "
            f"less than one request of {input_len:,}")


_MAX_FRACTION = 0.95  # the largest memory fraction a suggestion asks for


def _what_fits(base: dict) -> str:
    """The first of a few one-flag changes under which some layout holds a request."""
    tries: list[tuple[str, dict[str, Any]]] = [
        ("--weight-dtype fp8", {"weight_dtype": "fp8"}),
        ("--kv-dtype fp8", {"kv_dtype": "fp8"}),
        # the same ranks with less left for activations, graphs and the allocator
        *([(f"--memory-fraction {_MAX_FRACTION}", {"memory_fraction": _MAX_FRACTION})]
          if base["memory_fraction"] < _MAX_FRACTION else []),
        *((f"--tp {k * base['tp']}", {"tp": k * base["tp"]}) for k in (2, 4, 8))]
    for flag, change in tries:
        if all(base[k] == v for k, v in change.items()):
            continue
        try:
            alt = plan(**{**base, **change}, suggest=False)
        except ConfigError:
            continue
        if alt["chosen"]:
            return f"; {flag} would fit ({alt['reason']})"
    return "; no single change of dtypes, memory fraction or rank count makes it fit"


def plan_main(args) -> int:
    """`splash plan`: print the plan as one JSON object (--json) or as a table."""
    p = plan(args.model, args.hardware, args.tp_size, args.batch, args.input_len,
             args.memory_fraction, args.kv_dtype, args.weight_dtype,
             getattr(args, "calibration", None))
    if args.json:
        print(json.dumps(p))
        return 0
    print(f"{p['model']} on {p['tp']}x {p['hardware']} ({p['weight_dtype']} weights, "
          f"{p['kv_dtype']} KV), budget {p['budget_bytes_per_rank'] / GIB:.1f} GiB/rank")
    print(f"Q-B+KV-B+O {p['projection_mib_per_layer']} MiB/layer; sharded->replicated receives "
          f"{p['weight_allgather_mib_per_rank_per_layer']} MiB/rank/layer; KV "
          f"{p['kv_bytes_per_token_per_layer']}+{p['aux_kv_bytes_per_token_per_layer']} "
          "B/token/layer")
    print(f"\n{'layout':7}{'GiB/rank':>10}{'KV capacity':>13}{'resident':>10}{'step ms':>10}"
          f"{'tok/s':>10}  feasible  (batch {p['batch']} x {p['input_len']})")
    for name, lay in p["layouts"].items():
        print(f"{name:7}{lay['per_rank_bytes'] / GIB:>10.2f}{lay['kv_capacity_tokens']:>13,}"
              f"{lay['max_resident_requests']:>10}{lay['step_time_ms']:>10.3f}"
              f"{lay['decode_tok_s']:>10.0f}  {lay['feasible']}")
    print(f"\nchosen: {p['reason']}" if p["chosen"] else f"\n{p['reason']}")
    print(f"\n{'switch':10}{'W MiB/rank/layer':>18}{'KV MiB/rank/layer':>19}{'live ms':>10}"
          f"{'blocking ms':>13}  primitives")
    for key, s in p["switches"].items():
        print(f"{key:10}{s['weight_bytes_per_rank_per_layer'] / MIB:>18.1f}"
              f"{s['kv_bytes_per_rank_per_layer'] / MIB:>19.1f}{s['live_ms']:>10.2f}"
              f"{s['blocking_ms']:>13.2f}  {', '.join(s['primitives'])}")
    return 0
