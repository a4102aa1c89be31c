"""Two real gloo ranks for the unit tests of collective decisions: ``on_two_ranks(fn, *args)`` runs
``fn(rank, *args)`` in two spawned processes that share a process group, and returns ``{rank: result}``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist

from dschat.utils.dist import free_port


def _child(rank: int, port: int, fn: Callable, args: tuple, out) -> None:
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out.put((rank, fn(rank, *args)))
    finally:
        torch_dist.destroy_process_group()


def on_two_ranks(fn: Callable, *args, timeout: float = 120) -> dict[int, Any]:
    """``fn`` and ``args`` must be picklable (``fn`` defined at a module's top level). A rank that does
    not answer within ``timeout`` seconds (waiting in a collective its peer never reaches) fails the
    test with ``queue.Empty``; both processes are then killed. Both must exit cleanly."""
    ctx = torch.multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_child, args=(rank, port, fn, args, out)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=timeout) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]  # and both left the group cleanly
    return got
