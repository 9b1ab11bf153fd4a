"""`splash` command line: generate, serve, demo, plan, simulate, calibrate, make-model.

Each subcommand only parses arguments here and delegates to the module that owns the work.
Errors a user can act on end in one line on stderr and exit code 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from splash import __version__
from splash.errors import SplashError

LAYOUT_CHOICES = ["tp", "dp", "cp", "dop", "auto"]
PRESETS = ["deepseek-v3", "deepseek-v2-lite", "deepseek-v3.2", "kimi-k2", "glm-5"]
# one set of deployment assumptions for `plan` and `simulate` (the paper's: fp8 weights and KV)
DEPLOYMENT = {"hardware": "h200", "tp_size": 8, "weight_dtype": "fp8", "kv_dtype": "fp8"}
HARDWARE = ["h200", "b200", "bw1000", "cpu"]
DTYPES = ["fp8", "bf16", "fp16", "fp32"]
DESCRIPTION = ("SPLASH: serve MLA models (DeepSeek-V2/V3, Kimi-K2, GLM-5) on T ranks and switch "
               "the attention layout (TP, DP, CP, DOP) while requests keep running.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.required \
                or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0: a free port), got {text!r}")
    return port


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, dest="tp_size", help="ranks (worker processes)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "rocm"],
                   help="auto: ROCm, then CUDA, then CPU")
    p.add_argument("--layout", default="auto", choices=LAYOUT_CHOICES,
                   help="attention layout; auto follows the best one as the batch changes")
    p.add_argument("--dtype", default=None,
                   help="activation/weight dtype: fp32, fp16 or bf16 (default: fp32 on CPU, "
                        "bf16 on GPU; CPU has no bf16)")
    p.add_argument("--kv-dtype", default=None,
                   help="KV cache dtype: the --dtype (default) or fp8 on H200/B200")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: 16 on CPU, 64 on GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output limit (default: the model's)")
    p.add_argument("--kv-pages-per-rank", type=int, default=None,
                   help="KV pages per rank (default: from the memory budget)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (on by default on CUDA)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="schedule each step only once the step before is done (by default the "
                        "next step is scheduled while the device computes)")
    p.add_argument("--memory-fraction", type=float, default=0.85,
                   help="of device memory for weights, activations, CUDA graphs and KV (GPU)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests running at once (sets the largest decode step and graph)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="rows of the largest step, the prefill chunk (default: 256 on CPU, 2048 "
                        "on GPU); its activations are reserved at start-up")


def _sub(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)


def _deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default=DEPLOYMENT["hardware"], choices=HARDWARE,
                   help="hardware profile")
    p.add_argument("--tp", type=int, default=DEPLOYMENT["tp_size"], dest="tp_size",
                   help="ranks")
    p.add_argument("--weight-dtype", default=DEPLOYMENT["weight_dtype"], choices=DTYPES,
                   help="weights as deployed")
    p.add_argument("--kv-dtype", default=DEPLOYMENT["kv_dtype"], choices=DTYPES,
                   help="KV cache")
    p.add_argument("--calibration", default=None, help="measured profile JSON")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splash", description=DESCRIPTION,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"splash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = _sub(sub, "generate", "offline generation from token-id prompts")
    _engine_args(g)
    g.add_argument("--prompt-ids", nargs="+", default=None,
                   help="prompts as token ids 1,2,3, one per argument (default: 1,2,3)")
    g.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--layout-plan", default=None, help="forced switches, e.g. 3:dop,6:tp")
    g.add_argument("--json", action="store_true", help="one JSON object per request, then stats")
    g.set_defaults(handler="splash.cli.generate:generate_main")

    s = _sub(sub, "serve", "the ZeroMQ front door (+ optional OpenAI-compatible HTTP)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="off loopback a token is required")
    s.add_argument("--port", type=_port, default=5557, help="ZeroMQ port (0: a free one)")
    s.add_argument("--http-port", type=_port, default=None,
                   help="also serve OpenAI-compatible HTTP on this port")
    s.add_argument("--token", default=None,
                   help="shared secret (required off loopback; or --token-file, SPLASH_TOKEN)")
    s.add_argument("--token-file", default=None, help="file holding the shared secret")
    s.set_defaults(handler="splash.server.app:serve_main")

    d = _sub(sub, "demo", "tiny random model, 2 CPU workers, live layout switches")
    d.add_argument("--tp", type=int, default=2, dest="tp_size", help="CPU worker processes")
    d.add_argument("--requests", type=int, default=None, help="requests in the trace")
    d.add_argument("--out", default=None, help="where to write the timeline PNG and JSON")
    d.set_defaults(handler="splash.cli.demo:demo_main")

    pl = _sub(sub, "plan", "ownership + cost model for a preset or checkpoint")
    pl.add_argument("--model", required=True,
                    help=f"checkpoint dir or preset ({', '.join(PRESETS)})")
    _deployment_args(pl)
    pl.add_argument("--batch", type=int, default=16, help="requests decoding together")
    pl.add_argument("--input-len", type=int, default=4096, help="tokens of context each")
    pl.add_argument("--memory-fraction", type=float, default=0.85,
                    help="of device memory for weights + KV")
    pl.set_defaults(handler="splash.planning.planner:plan_main")

    sim = _sub(sub, "simulate", "discrete-event simulation of auto vs fixed layouts")
    sim.add_argument("--model", default="glm-5",
                     help=f"checkpoint dir or preset ({', '.join(PRESETS)})")
    _deployment_args(sim)
    sim.add_argument("--trace", default="rollout", help="rollout | agentic | chat | FILE.jsonl")
    sim.add_argument("--seed", type=int, default=0, help="trace seed")
    sim.add_argument("--requests", type=int, default=None,
                     help="requests in the trace (default: the trace's own)")
    sim.set_defaults(handler="splash.planning.reports:simulate_main")

    cal = _sub(sub, "calibrate", "measure this machine's hardware profile; with --model, fit "
               "the cost model to the engine's measured step and switch times")
    cal.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "rocm"],
                     help="auto: ROCm, then CUDA, then CPU")
    cal.add_argument("--tp", type=int, default=1, dest="tp_size",
                     help="ranks for the collective measurement and the engine")
    cal.add_argument("--model", default=None,
                     help="checkpoint dir: also time the engine in every layout and fit")
    cal.add_argument("--dtype", default=None, help="the engine's dtype (default: as served)")
    cal.add_argument("--out", default=None, help="profile JSON path (the table goes beside it)")
    cal.add_argument("--quick", action="store_true",
                     help="tiny sizes and a two-point sweep (tests, CPU)")
    cal.set_defaults(handler="splash.engine.calibration:calibrate_main")

    mm = _sub(sub, "make-model", "write a random HF-format checkpoint")
    mm.add_argument("out_dir", help="directory to write")
    mm.add_argument("--preset", required=True, choices=PRESETS, help="architecture")
    mm.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    mm.add_argument("--seed", type=int, default=0, help="weight seed")
    mm.add_argument("--scale", default="tiny", choices=["tiny", "full"],
                    help="tiny dimensions for tests and demos, or the real ones")
    mm.set_defaults(handler="splash.model.presets:make_model_main")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        module_name, func_name = args.handler.split(":")
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except SplashError as e:
        print(f"splash {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"splash {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`splash plan | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # files and sockets: a missing path, a permission, a busy port
        print(f"splash {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
