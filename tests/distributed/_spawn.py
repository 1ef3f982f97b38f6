"""Run a function on N gloo ranks in spawned processes and bring rank 0's result back.

Each test spawns its own processes (no launcher needed) and compares what rank 0
returns with a single-process reference computed in the test itself.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)  # a hang becomes an error, never a stuck suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, folder: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    except BaseException:
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's return value.

    ``fn`` must be a module-level function. A failing rank fails the call with its traceback.
    """
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.spawn(_entry, args=(world, _free_port(), folder, fn, args), nprocs=world, join=True)
        except mp.ProcessRaisedException as exc:
            errors = sorted(Path(folder).glob("*.err"))
            details = "\n".join(f"--- {p.stem}\n{p.read_text()}" for p in errors)
            raise AssertionError(f"a rank failed:\n{details}") from exc
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True) for r in range(world)]
