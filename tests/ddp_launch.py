"""Run a function on N torch.distributed (Gloo) workers from pytest, as torchrun would start them.

``run_ddp(fn, np)`` spawns ``np`` processes with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: ``local_size`` consecutive ranks per emulated node), initialises a
Gloo process group in each, calls ``fn(**kwargs)`` and returns the results ordered by rank. A worker
that raises fails the call with its traceback; a job past ``timeout`` seconds is killed and fails.
``fn`` must be a module-level function (spawned processes import it).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable[..., Any], kwargs: dict[str, Any], np: int, local_size: int, port: int,
            outdir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(np), LOCAL_RANK=str(rank % local_size),
                      LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=np, timeout=datetime.timedelta(seconds=90))
    try:
        result = fn(**kwargs)
    finally:
        dist.destroy_process_group()
    Path(outdir, f"result.{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ddp(fn: Callable[..., Any], np: int = 2, kwargs: dict[str, Any] | None = None, local_size: int | None = None,
            timeout: float = 240) -> list[Any]:
    """``fn(**kwargs)`` on ``np`` Gloo workers (see the module docstring); the results by rank."""
    with tempfile.TemporaryDirectory(prefix="hvdcomp-ddp-") as outdir:
        context = mp.start_processes(_worker, args=(fn, kwargs or {}, np, local_size or np, _free_port(), outdir),
                                     nprocs=np, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(max(0.1, deadline - time.monotonic())):  # False while some still run
                if time.monotonic() > deadline:
                    raise AssertionError(f"{fn.__name__} on {np} workers did not finish in {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [pickle.loads(Path(outdir, f"result.{rank}.pkl").read_bytes()) for rank in range(np)]
