"""`splash` command line: generate, serve, demo, plan, simulate, calibrate, make-model.

Each subcommand only parses arguments here and delegates to the module that owns the work.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from splash.errors import SplashError

LAYOUT_CHOICES = ["tp", "dp", "cp", "dop", "auto"]
PRESETS = ["deepseek-v3", "deepseek-v2-lite", "deepseek-v3.2", "kimi-k2", "glm-5"]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, dest="tp_size", help="ranks (worker processes)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "rocm"])
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES)
    p.add_argument("--dtype", default=None, help="activation/weight dtype (default per backend)")
    p.add_argument("--kv-dtype", default=None, help="KV dtype: bf16, fp16, fp32 or fp8")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-pages-per-rank", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (on by default on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation from token-id prompts")
    _engine_args(g)
    g.add_argument("--prompt-ids", nargs="+", default=[], help="prompts as 1,2,3 (one per arg)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--layout-plan", default=None, help="forced switches, e.g. 3:dop,6:tp")
    g.add_argument("--json", action="store_true", help="one JSON object per request, then stats")
    g.set_defaults(handler="splash.cli.generate:generate_main")

    s = sub.add_parser("serve", help="the ZeroMQ front door (+ optional OpenAI-compatible HTTP)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5557)
    s.add_argument("--http-port", type=int, default=None, help="also serve OpenAI-style HTTP")
    s.add_argument("--token", default=None, help="shared secret (required off loopback)")
    s.add_argument("--token-file", default=None, help="file holding the shared secret")
    s.set_defaults(handler="splash.server.app:serve_main")

    d = sub.add_parser("demo", help="tiny random model, 2 CPU workers, live layout switches")
    d.add_argument("--tp", type=int, default=2, dest="tp_size")
    d.add_argument("--requests", type=int, default=None)
    d.add_argument("--out", default=None, help="where to write the timeline PNG and JSON")
    d.set_defaults(handler="splash.cli.demo:demo_main")

    pl = sub.add_parser("plan", help="ownership + cost model for a preset or checkpoint")
    pl.add_argument("--model", required=True, help=f"checkpoint dir or preset {PRESETS}")
    pl.add_argument("--hardware", default="h200", choices=["h200", "b200", "bw1000", "cpu"])
    pl.add_argument("--tp", type=int, default=8, dest="tp_size")
    pl.add_argument("--batch", type=int, default=16)
    pl.add_argument("--input-len", type=int, default=4096)
    pl.add_argument("--memory-fraction", type=float, default=0.85)
    pl.add_argument("--kv-dtype", default="bf16")
    pl.add_argument("--weight-dtype", default="bf16")
    pl.add_argument("--calibration", default=None, help="measured profile JSON")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(handler="splash.planning.planner:plan_main")

    sim = sub.add_parser("simulate", help="discrete-event simulation of auto vs fixed layouts")
    sim.add_argument("--model", default="glm-5")
    sim.add_argument("--hardware", default="b200", choices=["h200", "b200", "bw1000", "cpu"])
    sim.add_argument("--tp", type=int, default=8, dest="tp_size")
    sim.add_argument("--trace", default="rollout", help="rollout | agentic | chat | FILE.jsonl")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--requests", type=int, default=None, help="requests in the trace")
    sim.add_argument("--weight-dtype", default="fp8")
    sim.add_argument("--kv-dtype", default="fp8")
    sim.add_argument("--calibration", default=None, help="measured profile JSON")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(handler="splash.planning.reports:simulate_main")

    cal = sub.add_parser("calibrate", help="measure this machine's hardware profile")
    cal.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "rocm"])
    cal.add_argument("--tp", type=int, default=1, dest="tp_size")
    cal.add_argument("--out", default=None, help="profile JSON path")
    cal.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    cal.set_defaults(handler="splash.planning.calibrate:calibrate_main")

    mm = sub.add_parser("make-model", help="write a random HF-format checkpoint")
    mm.add_argument("out_dir")
    mm.add_argument("--preset", required=True, choices=PRESETS)
    mm.add_argument("--layers", type=int, default=None)
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--scale", default="tiny", choices=["tiny", "full"])
    mm.set_defaults(handler="splash.model.presets:make_model_main")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(handler(args) or 0)
    except SplashError as e:
        print(f"splash {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
