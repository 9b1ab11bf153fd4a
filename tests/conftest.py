"""Suite-wide set-up: kernels run under the Triton interpreter unless a GPU test selects CUDA;
one torch thread per xdist worker (2 cores, 2 workers, spawned engine processes)."""

from __future__ import annotations

import os

import pytest
import torch

if not os.environ.get("SPLASH_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


# modules whose tests share an engine (a module-scoped fixture): under xdist each one runs on a
# single worker, so its engine starts once, not once on each worker that draws one of its tests
SHARED_ENGINE_MODULES = frozenset({
    "tests/reference/test_bad_input.py", "tests/reference/test_engine_sampling.py",
    "tests/reference/test_stop.py", "tests/e2e/test_serve_rollout.py",
})

# the order work is handed out in: the multi-rank tests (up to minutes each) and the engine
# tests (seconds to a minute) first, the kernel tests next, the rest (mostly milliseconds) last, so that no long test starts when the
# other worker is nearly done (the run would then wait for it alone)
FIRST_DIRS = ("tests/dist/", "tests/reference/", "tests/e2e/", "tests/kernels/")

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # no xdist: nothing is distributed
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _SharedEngineScheduling(LoadScopeScheduling):
        """``--dist load`` (what ``-n`` gives): test by test to whichever worker is free,
        except that each of SHARED_ENGINE_MODULES goes to one worker whole (xdist's
        ``loadgroup`` would do it with marks, but it renames items through ``_nodeid``,
        which pytest 9 no longer reads), in the order of FIRST_DIRS."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_ENGINE_MODULES else nodeid

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_ordered", False):  # the queue is complete by the first
                rank = {d: i for i, d in enumerate(FIRST_DIRS)}

                def order(scope: str) -> int:
                    return next((r for d, r in rank.items() if scope.startswith(d)), len(rank))

                queue = sorted(self.workqueue.items(), key=lambda unit: order(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(queue)
                self._ordered = True
            super()._assign_work_unit(node)

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "load":
            return _SharedEngineScheduling(config, log)
        return None
