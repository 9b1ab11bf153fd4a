"""Seeded synthetic traces: rollout, agentic, chat, stationary, and the JSONL loader.

They live in `splash.planning.workloads` (so `splash simulate` works from an install); this script is
the benchmarks' entry point:  python benchmarks/workloads.py rollout --n 256 --seed 0
"""

from splash.planning.workloads import *  # noqa: F401,F403
from splash.planning.workloads import main

if __name__ == "__main__":
    raise SystemExit(main())
