"""DeepSpeed's CPU all-reduce maps one /dev/shm segment per rank when every rank is on one machine (the
DeepSpeed launcher sets LOCAL_SIZE) and never unlinks it: each such run used to leave 2 x 66 MB of RAM in
/dev/shm until reboot. After a day of tests that was 20 GB, and the next compiler run was killed."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from dschat.utils.dist import free_port


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
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
def test_a_two_rank_cpu_run_leaves_no_shared_memory_behind():
    port = free_port()
    leftovers = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=300) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        found = glob.glob(leftovers)
        for path in found:  # never leak, even when the test fails
            os.unlink(path)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == {0: [3.0] * 4, 1: [3.0] * 4}
    assert found == []
