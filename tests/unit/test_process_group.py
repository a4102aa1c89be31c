"""The process group around a run: barriers that name their device, and run_cli tearing the group down
before exit (exit codes kept), so that NCCL adds no warning lines to a run's output."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from dschat.utils import dist
from dschat.utils.dist import free_port
from dschat.utils.errors import EXIT_USER_ERROR, UserError, run_cli


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real one-rank gloo process group, as a training entry point has after init_distributed."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    yield lambda: torch_dist.init_process_group("gloo", rank=0, world_size=1)
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


@pytest.mark.parametrize(("outcome", "code"), [("returns", 0), ("bad input", EXIT_USER_ERROR)])
def test_the_process_group_is_destroyed_before_exit(one_rank_group, outcome, code):
    # Without it NCCL prints "destroy_process_group() was not called before program exit" after
    # every run on a GPU, right under a bad-input line that must stay the only line.
    def main() -> int:
        one_rank_group()
        if outcome == "bad input":
            raise UserError("--flag: bad")
        return 0

    with pytest.raises(SystemExit) as stop:
        run_cli(main)
    assert stop.value.code == code
    assert not torch_dist.is_initialized()


def test_a_barrier_names_its_gpu_under_nccl(one_rank_group, monkeypatch):
    # Unnamed, NCCL guesses the device from the rank and warns twice (seen on an H200, one rank).
    one_rank_group()
    dist.barrier()  # a real gloo barrier: no device to name
    calls = []
    monkeypatch.setattr(torch_dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch_dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    dist.barrier()
    assert calls == [{"device_ids": [3]}]
