"""Run a function on N gloo ranks in spawned processes and bring rank 0's result back.

Each test spawns its own processes (no launcher needed) and compares what rank 0
returns with a single-process reference computed in the test itself.

The ranks meet through a file in a private folder rather than a TCP port, so runs that
happen at the same time (other suites, other users) cannot meet each other's ranks.
Each rank ends in step with the others: it collects what its function left in reference
cycles (unwaited sends, hooks) while its process group still exists, waits at a barrier
so no rank tears down a connection another is still using, then destroys the group, so
nothing of gloo is left for the interpreter's shutdown to free.
"""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# generous: on a loaded machine a peer may take long to import a model; a hang still
# becomes an error rather than a stuck suite
TIMEOUT = datetime.timedelta(seconds=300)


def _entry(rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        del result
        gc.collect()
        dist.barrier()
    except BaseException:
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's return value.

    ``fn`` must be a module-level function. A failing rank fails the call with its traceback.
    """
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.spawn(_entry, args=(world, folder, fn, args), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # a rank raised, or died of a signal
            errors = sorted(Path(folder).glob("*.err"))
            details = "\n".join(f"--- {p.stem}\n{p.read_text()}" for p in errors)
            raise AssertionError(f"a rank failed:\n{details}") from exc
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True) for r in range(world)]
