"""Where the processes of a group meet: a rendezvous store their parent binds before starting
them. Picking a free port, releasing it and letting rank 0 bind it later races with anything
else on the machine that binds ports meanwhile (another engine, a parallel test), and a peer can
then even join a stranger's store."""

from __future__ import annotations

import datetime

import torch.distributed as dist

_PREFIX = "store://"


def host_store(port: int = 0, timeout_s: float = 600.0) -> tuple[dist.TCPStore, str]:
    """A store bound now on loopback (``port`` 0: any free one), and the address the group's
    processes pass to `join_group`. Keep the store alive while they run."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{_PREFIX}127.0.0.1:{store.port}"


def join_group(backend: str, init: str, rank: int, world: int, timeout_s: float = 600.0) -> None:
    """Join the default process group: ``init`` is an address from `host_store`, or any torch
    init method (``env://`` under torchrun)."""
    if init.startswith(_PREFIX):
        host, port = init.removeprefix(_PREFIX).rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
