"""The worker process's entry and ZeroMQ loop: receive a plan, launch it, send its result once
the device is done — or, when the next plan arrives before that, launch it behind and then
send the earlier result (results always go back in step order).

The worker's DEALER socket connects to the controller's ROUTER. At start-up it loads its weights,
runs the profiling steps and reports them (`WorkerProfile`), allocates the KV pool the
controller sizes from every rank's report (`KVPoolSize`), captures its start-up CUDA graphs and
reports ready (`WorkerReady`). A worker exits when told to, when the controller process
disappears, or after reporting an exception (a failed collective leaves the group unusable; the
controller fails the in-flight requests) — except an out-of-memory error of a single-rank
group outside a switch, after which it frees its cached memory and serves on (the controller
fails that step's requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import signal
import time
import traceback

import msgspec
import torch
import zmq

from splash.core.protocol import (
    WORKER_PROTOCOL_VERSION,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerProfile,
    WorkerReady,
    decode_plan,
    decode_pool_size,
    encode,
)
from splash.engine.worker import Launched, Worker, recoverable
from splash.engine.worker_config import WorkerConfig


def _connect(rank: int, controller_addr: str):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(controller_addr)
    return ctx, sock


def serve_external(controller_addr: str) -> None:
    """Entry under torchrun: rank and world from its environment, the rest from the
    controller (sent in reply to a hello), rendezvous through env://."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx, sock = _connect(rank, controller_addr)
    sock.send(encode(WorkerHello(rank, world)))
    fields = msgspec.json.decode(sock.recv())
    cfg = WorkerConfig(**fields)
    cfg = dataclasses.replace(cfg, rank=rank, world=world, dist_init="env://")
    _serve(cfg, ctx, sock)


def serve_plans(cfg, controller_addr: str) -> None:
    ctx, sock = _connect(cfg.rank, controller_addr)
    _serve(cfg, ctx, sock)


def _start(cfg, sock, poller, parent: int) -> Worker | None:
    """Load the weights, run the profiling steps, report them; allocate the KV pool the
    controller answers with, capture the start-up graphs, report ready. None: start-up failed
    (reported) or the controller refused to go on."""
    try:
        worker = Worker(cfg)
    except Exception as e:  # report start-up failures instead of dying silently
        sock.send(encode(WorkerProfile(cfg.rank, os.getpid(), "", error=f"{type(e).__name__}: {e}")))
        return None
    try:
        sock.send(encode(worker.profile_report()))
        while not poller.poll(1000):
            if os.getppid() != parent:
                return None
        try:
            size = decode_pool_size(sock.recv())
        except msgspec.DecodeError:  # a shutdown plan: the controller refused the setup
            return None
        sock.send(encode(worker.allocate(size.num_pages)))
    except Exception as e:
        traceback.print_exc()
        sock.send(encode(WorkerReady(cfg.rank, os.getpid(), 0, "", error=f"{type(e).__name__}: {e}")))
        worker.shutdown()
        return None
    return worker


def _serve(cfg, ctx, sock) -> None:
    parent = os.getppid()
    if hasattr(signal, "SIGUSR1"):  # the controller asks a silent worker for its stacks
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    worker = _start(cfg, sock, poller, parent)
    if worker is None:
        sock.close()
        ctx.term()
        return
    pending: Launched | None = None  # a launched step not reported yet

    def report(out: Launched) -> bool:
        try:
            result = worker.finish(out)
        except Exception as e:
            return fail(e, out.plan)
        sock.send(encode(result))
        return True

    def fail(e: Exception, plan: StepPlan) -> bool:
        keep = recoverable(e, plan, cfg.world)
        if keep:  # only this step's requests fail; the worker serves on
            worker.recover()
        else:
            traceback.print_exc()
        sock.send(encode(StepResult(WORKER_PROTOCOL_VERSION, plan.step, cfg.rank,
                                    error=f"{type(e).__name__}: {e}", recoverable=keep)))
        return keep

    try:
        while True:
            if pending is not None:
                # the next plan may come before the device finishes this step (the controller
                # schedules ahead): it is launched behind it, so the device never waits for
                # the host between the two; a finished step is reported first
                while not pending.ready() and not poller.poll(0):
                    time.sleep(0)
                if pending.ready():
                    if not report(pending):
                        break
                    pending = None
                    continue
            elif not poller.poll(1000):
                if os.getppid() != parent:  # controller gone: nothing left to serve
                    break
                continue
            plan = decode_plan(sock.recv())
            if plan.shutdown:
                break
            try:
                launched = worker.launch(plan)
            except Exception as e:
                if pending is not None and not report(pending):  # the earlier step first
                    break
                pending = None
                if not fail(e, plan):
                    break
                continue
            if pending is not None and not report(pending):
                break
            pending = launched
    finally:
        worker.shutdown()
        sock.close()
        ctx.term()


def worker_main(cfg: WorkerConfig, controller_addr: str) -> None:
    """Process entry: connect to the controller, report ready, serve step plans until told
    to stop or the controller goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    serve_plans(cfg, controller_addr)


def main() -> None:
    """`python -m splash.engine.worker_loop --controller tcp://HOST:PORT` under torchrun."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--controller", required=True, help="the controller's worker address")
    serve_external(ap.parse_args().controller)


if __name__ == "__main__":
    main()
