"""How the controller reaches its workers: in-process (T=1 on a GPU) or spawned processes over
ZeroMQ (T>1, and always on the CPU backend).

Both start in two phases: the workers load their weights and report their profiling steps
(`profiles`), then allocate the KV pool the controller sized from them (`allocate`). Both take
one StepPlan per rank and return one StepResult per rank: `submit` issues a step, `collect`
waits for the oldest step issued (a second step may be submitted before the first is
collected: the workers launch it behind the first), `execute` does both. A dead or silent
worker, or one that reports an error, raises WorkerDiedError within seconds (the first error
ends the wait: its peers may be stuck in a collective); nothing waits forever. A step that
failed on a worker that kept its state raises StepFailedError. The time a silent worker is
given (SPLASH_WORKER_TIMEOUT_S) counts only while the controller runs: after the controller
was paused (Ctrl-Z then fg, a suspended machine) its workers get their full time again
instead of being declared dead for the pause.

Spawned workers start with SIGINT ignored (Ctrl-C in a terminal reaches the whole process
group; the controller alone handles it and stops its workers) and, on the CPU backend, with
TRITON_INTERPRET=1 in their environment before anything is imported: Triton fixes a kernel's
interpreter mode when the kernel is defined, so a CPU worker in a process that imported Triton
earlier (directly or through torch._dynamo) would mix compiled and interpreted kernels.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import msgspec
import torch
import zmq
from safetensors.torch import save_file

from splash import envs
from splash.core.pause import PauseClock
from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    KVPoolSize,
    StepPlan,
    StepResult,
    WeightLoad,
    WorkerHello,
    WorkerProfile,
    WorkerReady,
    decode_result,
    encode,
)
from splash.dist.rendezvous import host_store
from splash.engine.worker import Launched, Worker, recoverable
from splash.engine.worker_config import WorkerConfig
from splash.engine.worker_loop import worker_main
from splash.errors import StepFailedError, WorkerDiedError
from splash.logging_utils import get_logger
from splash.model.loader import CheckpointWeights

logger = get_logger("splash.executor")


class _Executor:
    """What every executor shares: `execute` is `submit` then `collect`."""

    def submit(self, plans: list[StepPlan]) -> None:
        raise NotImplementedError

    def collect(self, plans: list[StepPlan],
                while_waiting: Callable[[], None] | None = None) -> list[StepResult]:
        raise NotImplementedError

    def execute(self, plans: list[StepPlan],
                while_waiting: Callable[[], None] | None = None) -> list[StepResult]:
        """The step's results; ``while_waiting`` runs on the host while the workers compute."""
        self.submit(plans)
        return self.collect(plans, while_waiting)


class InprocExecutor(_Executor):
    """T=1 on a GPU: the worker lives in the controller's process; plans still go through msgspec."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.worker: Worker | None = Worker(cfg)
        self.pids: list[int] = []
        self.profiles = [self.worker.profile_report()]
        self._launched: collections.deque[Launched | Exception] = collections.deque()

    def allocate(self, num_pages: int) -> list[WorkerReady]:
        assert self.worker is not None
        return [self.worker.allocate(num_pages)]

    def load_weights(self, source: str | Mapping[str, torch.Tensor], names: list[str],
                     step: int) -> None:
        """Copy new values of ``names`` (a checkpoint directory's, or the mapping's) in place."""
        if self.worker is None:
            raise WorkerDiedError("the engine was shut down")
        weights = source if isinstance(source, Mapping) else CheckpointWeights(
            source, self.worker.model.cfg)
        self.worker.load_weights(weights, names)

    def submit(self, plans: list[StepPlan]) -> None:
        """Launch the step on the device (the host returns before the device is done)."""
        if self.worker is None:
            raise WorkerDiedError("the engine was shut down")
        try:
            self._launched.append(self.worker.launch(plans[0]))
        except Exception as e:  # reported in step order, by collect
            if not recoverable(e, plans[0], 1):
                raise
            self._launched.append(e)

    def collect(self, plans: list[StepPlan],
                while_waiting: Callable[[], None] | None = None) -> list[StepResult]:
        """The results of the oldest step submitted (``plans``)."""
        _run_aside(while_waiting)
        if self.worker is None:
            raise WorkerDiedError("the engine was shut down")
        launched = self._launched.popleft()
        if isinstance(launched, Exception):
            self.worker.recover()
            raise StepFailedError(f"worker 0 failed step {plans[0].step}: "
                                  f"{type(launched).__name__}: {launched}") from launched
        result = self.worker.finish(launched)
        if result.error:
            raise WorkerDiedError(f"worker 0 failed: {result.error}")
        return [result]

    def alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Release the worker and its device memory: the weights, KV pools and graphs live in
        this process, and the next engine's memory budget counts what is still held here."""
        if self.worker is None:
            return
        self._launched.clear()
        self.worker.shutdown()
        on_gpu = self.worker.device.type == "cuda"
        self.worker = None
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()


class MPExecutor(_Executor):
    """T spawned worker processes; ROUTER here, one DEALER per worker."""

    def __init__(self, cfg: WorkerConfig, start_timeout_s: float = 600.0) -> None:
        self.world = cfg.world
        self.timeout_s = envs.get_float("SPLASH_WORKER_TIMEOUT_S")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        self.store: object | None = None  # the workers' rendezvous, bound before they start
        dist_init = ""
        if cfg.world > 1:
            self.store, dist_init = host_store(envs.get_int("SPLASH_MASTER_PORT"),
                                               start_timeout_s)
        spawn = mp.get_context("spawn")
        self.procs = []
        env = {"TRITON_INTERPRET": "1"} if cfg.backend == "cpu" else {}
        with _child_environment(env), _sigint_ignored():
            for rank in range(cfg.world):
                wcfg = replace(cfg, rank=rank, dist_init=dist_init)
                proc = spawn.Process(target=worker_main, args=(wcfg, addr), daemon=True,
                                     name=f"splash-worker-{rank}")
                proc.start()
                self.procs.append(proc)
        self.pids = [p.pid for p in self.procs]
        self.start_timeout_s = start_timeout_s
        self._early: dict[int, collections.deque] = {}  # rank: results of later steps
        self.profiles = self._start_messages(WorkerProfile, "start")

    def _start_messages(self, kind: type, what: str) -> list:
        try:
            msgs = self._gather(self.start_timeout_s, what)
        except WorkerDiedError:
            self.shutdown()
            raise
        for msg in msgs:
            if not isinstance(msg, kind):
                self.shutdown()
                raise WorkerDiedError(f"unexpected start-up message {msg!r}")
        return msgs

    def allocate(self, num_pages: int) -> list[WorkerReady]:
        """Every worker allocates ``num_pages`` KV pages and captures its start-up graphs."""
        for rank in range(self.world):
            self.sock.send_multipart([f"worker-{rank}".encode(), encode(KVPoolSize(num_pages))])
        ready = self._start_messages(WorkerReady, "KV pool allocation and graph capture")
        errors = [m for m in ready if m.error]
        if errors:
            self.shutdown()
            raise WorkerDiedError(f"worker {errors[0].rank} failed to start: {errors[0].error}")
        logger.info("%d workers ready (pids %s)", self.world, self.pids)
        return ready

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _gather(self, timeout_s: float, what: str) -> list:
        """One message per rank, in each rank's order (a rank's messages for a later step,
        arriving before a slower peer's for this one, wait for the next gather)."""
        got: dict[int, object] = {r: q.popleft() for r, q in self._early.items() if q}
        try:
            return self._gather_into(got, timeout_s, what)
        except BaseException:  # Ctrl-C or a timeout: what came stays for the next gather
            for rank, msg in got.items():
                self._early.setdefault(rank, collections.deque()).appendleft(msg)
            raise

    def _gather_into(self, got: dict[int, object], timeout_s: float, what: str) -> list:
        if any(_fatal(m) for m in got.values()):
            return [*(m for m in got.values() if _fatal(m)), *self._errors_within(0.5)]
        deadline = _Deadline(timeout_s)
        while len(got) < self.world:
            if self.sock.poll(200):
                with sigint_deferred():  # a message taken off the socket is always kept
                    ident, payload = self.sock.recv_multipart()
                    rank = int(ident.decode().split("-")[1])
                    msg = decode_result(payload)
                    if rank in got:
                        self._early.setdefault(rank, collections.deque()).append(msg)
                        continue
                    got[rank] = msg
                if _fatal(msg):
                    # its peers may wait in a collective for it: stop here, with the errors
                    # that arrive meanwhile (a peer's may come first and only echo this one)
                    earlier = [m for r, m in got.items() if r != rank and
                               getattr(m, "error", None)]
                    return [*earlier, msg, *self._errors_within(0.5)]
                continue
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]  # spawned only
            if dead and not all(r in got for r in dead):
                codes = {r: self.procs[r].exitcode for r in dead}
                raise WorkerDiedError(f"worker(s) {dead} exited (codes {codes}) during {what}")
            if deadline.passed():
                missing = sorted(set(range(self.world)) - set(got))
                self._dump_stacks(missing)
                raise WorkerDiedError(f"worker(s) {missing} did not answer within "
                                      f"{timeout_s:.0f} s during {what}")
        return [got[r] for r in range(self.world)]

    def _errors_within(self, seconds: float) -> list:
        """The error reports that arrive within ``seconds``."""
        out, deadline = [], time.monotonic() + seconds
        while self.sock.poll(max(int((deadline - time.monotonic()) * 1e3), 0)):
            msg = decode_result(self.sock.recv_multipart()[1])
            if getattr(msg, "error", None):
                out.append(msg)
        return out

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask silent workers to print every thread's Python stack to their stderr."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for r in ranks:
            pid = self.procs[r].pid if r < len(self.procs) else None
            if pid is not None and self.procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
        logger.error("worker(s) %s silent: their stacks follow on stderr", ranks)
        time.sleep(0.5)

    def load_weights(self, source: str | Mapping[str, torch.Tensor], names: list[str],
                     step: int) -> None:
        """Every worker copies new values of ``names`` in place; a mapping reaches them as a
        temporary safetensors file (workers on other hosts need a shared filesystem)."""
        tmp = None
        if isinstance(source, Mapping):
            tmp = tempfile.mkdtemp(prefix="splash-weights-")
            save_file({n: source[n].detach().to("cpu").contiguous() for n in names},
                      os.path.join(tmp, "model.safetensors"))
            source = tmp
        try:
            plan = msgspec.structs.replace(_shutdown_plan(), step=step, shutdown=False,
                                           load_weights=WeightLoad(str(source), names))
            self.execute([plan] * self.world)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def submit(self, plans: list[StepPlan]) -> None:
        with sigint_deferred():  # every rank gets the step or none does (Ctrl-C mid-send left
            self._send(plans)  # one rank waiting in a collective for a peer that never came)

    def collect(self, plans: list[StepPlan],
                while_waiting: Callable[[], None] | None = None) -> list[StepResult]:
        """The results of the oldest step submitted (``plans``)."""
        _run_aside(while_waiting)
        return self._results(plans)

    def _send(self, plans: list[StepPlan]) -> None:
        for rank, plan in enumerate(plans):
            self.sock.send_multipart([f"worker-{rank}".encode(), encode(plan)])

    def _results(self, plans: list[StepPlan]) -> list[StepResult]:
        results = self._gather(self.timeout_s, f"step {plans[0].step}")
        errors = [r for r in results if isinstance(r, StepResult) and r.error]
        if errors:
            e = errors[0]
            if all(r.recoverable for r in errors):
                raise StepFailedError(f"worker {e.rank} failed step {e.step}: {e.error}")
            raise WorkerDiedError("; ".join(f"worker {e.rank} failed: {e.error}"
                                            for e in sorted(errors, key=lambda e: e.rank)))
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        graceful = self.alive()  # a group with a dead member may be stuck in a collective
        for rank, proc in enumerate(self.procs):
            if proc.is_alive() and not graceful:
                proc.kill()
            elif proc.is_alive():
                try:
                    self.sock.send_multipart(
                        [f"worker-{rank}".encode(), encode(_shutdown_plan())], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        self.store = None  # the rendezvous port is free again
        self.sock.close()
        self.ctx.term()


@contextlib.contextmanager
def sigint_deferred():
    """SIGINT held back (delivered on exit) where the platform allows it."""
    block = getattr(signal, "pthread_sigmask", None)
    if block is None:
        yield
        return
    old = block(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        block(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _child_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ plus ``env`` while children are spawned (they copy it), then as before."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while children are spawned: an ignored signal stays ignored across exec,
    and Python then installs no KeyboardInterrupt handler, so a worker never sees Ctrl-C, even
    while it imports. (Off the main thread signals cannot be changed; workers also ignore
    SIGINT first thing, in worker_main.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _shutdown_plan() -> StepPlan:
    return StepPlan(WORKER_PROTOCOL_VERSION, -1, "tp", [], [], [], [], [], [], [], [], [],
                    shutdown=True)


class ExternalExecutor(MPExecutor):
    """Workers started elsewhere (torchrun, several nodes) connect to ``bind_addr``; each says
    hello with its rank and gets the worker configuration back. Liveness comes from step
    timeouts (SPLASH_WORKER_TIMEOUT_S): there are no process handles here."""

    def __init__(self, cfg: WorkerConfig, bind_addr: str, start_timeout_s: float = 600.0) -> None:
        self.world = cfg.world
        self.timeout_s = envs.get_float("SPLASH_WORKER_TIMEOUT_S")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind_addr)
        self.procs = []
        self._early = {}
        logger.info("waiting for %d workers on %s (start them with torchrun: "
                    "python -m splash.engine.worker_loop --controller %s)", cfg.world, bind_addr,
                    bind_addr)
        hellos = self._gather(start_timeout_s, "hello")
        if any(not isinstance(h, WorkerHello) or h.world != cfg.world for h in hellos):
            raise WorkerDiedError(f"workers disagree on the world size {cfg.world}: {hellos}")
        payload = msgspec.json.encode(dataclasses.asdict(cfg))
        for rank in range(cfg.world):
            self.sock.send_multipart([f"worker-{rank}".encode(), payload])
        self.start_timeout_s = start_timeout_s
        self.profiles = self._start_messages(WorkerProfile, "start")
        self.pids = [m.pid for m in self.profiles]

    def alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        for rank in range(self.world):
            try:
                self.sock.send_multipart([f"worker-{rank}".encode(), encode(_shutdown_plan())],
                                         zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        time.sleep(0.2)
        self.sock.close()
        self.ctx.term()


class _Deadline:
    """A time limit on waiting that counts only the time this process ran (``PauseClock``)."""

    def __init__(self, seconds: float) -> None:
        self.clock = PauseClock()
        self.end = self.clock.last + seconds

    def passed(self) -> bool:
        paused = self.clock.pause()
        if paused:
            self.end += paused
            logger.warning("the controller did not run for %.0f s (stopped or suspended): "
                           "the pause does not count against its workers", paused)
        return self.clock.last > self.end


def _fatal(msg: object) -> bool:
    """A worker's report of an error it does not serve on after."""
    return bool(getattr(msg, "error", None)) and not getattr(msg, "recoverable", False)


def _run_aside(work: Callable[[], None] | None) -> None:
    """Host work overlapped with a step: its failure is logged and never loses the step."""
    if work is None:
        return
    try:
        work()
    except Exception:  # noqa: BLE001 - the step's results must still be collected
        logger.exception("host work overlapped with a step failed; the step goes on")


def start_executor(cfg: WorkerConfig, worker_addr: str | None = None):
    """In-process at T=1 on a GPU, spawned workers otherwise (CPU workers always get their own
    process, where the Triton interpreter is switched on before anything imports Triton), or
    torchrun-started ones at ``worker_addr``."""
    if worker_addr:
        return ExternalExecutor(cfg, worker_addr)
    if cfg.world == 1 and cfg.backend != "cpu":
        return InprocExecutor(cfg)
    return MPExecutor(cfg)
