"""DeepSpeed's CPU all-reduce maps one /dev/shm segment per rank when every rank is on one machine (the
DeepSpeed launcher sets LOCAL_SIZE) and never unlinks it: each such run used to leave 2 x 66 MB of RAM in
/dev/shm until reboot. After a day of tests that was 20 GB, and the next compiler run was killed."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from dschat.utils.dist import free_port


def _rank(rank: int, world: int, port: int, out) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import deepspeed.comm as ds_comm

    from dschat.engine import init_distributed

    init_distributed()
    # DeepSpeed's own shared-memory all-reduce, after the names are gone: the mappings still work.
    t = torch.full((4,), float(rank + 1))
    ds_comm.inference_all_reduce(t)
    out.put((rank, t.tolist()))
    ds_comm.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])  # the DeepSpeed launcher sets LOCAL_SIZE for one rank too
def test_a_cpu_run_leaves_no_shared_memory_behind(monkeypatch, world):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the spawned ranks inherit it: gloo, as on a CPU machine
    port = free_port()
    leftovers = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, world, port, out)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=300) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        found = glob.glob(leftovers)
        for path in found:  # never leak, even when the test fails
            os.unlink(path)
    assert [p.exitcode for p in procs] == [0] * world
    total = float(sum(range(1, world + 1)))
    assert got == {rank: [total] * 4 for rank in range(world)}
    assert found == []
