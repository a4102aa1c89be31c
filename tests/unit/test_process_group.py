"""The process group around a run: barriers that name their device, and run_cli tearing the group down
before exit (exit codes kept), so that NCCL adds no warning lines to a run's output."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from dschat.lm import within_rounding
from dschat.utils import dist
from dschat.utils.dist import free_port
from dschat.utils.errors import EXIT_USER_ERROR, UserError, run_cli
from tests.unit.gloo import on_two_ranks


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


def _decide(rank: int, diffs: list[float], flags: list[bool]):
    return within_rounding(diffs[rank], torch.bfloat16), dist.any_rank(flags[rank])


@pytest.mark.parametrize(
    ("diffs", "flags", "want"),
    [([0.01, 0.5], [False, True], (False, 0.5, True)), ([0.02, 0.01], [False, False], (True, 0.02, False))],
)
def test_ranks_that_measure_differently_decide_together(diffs, flags, want):
    # Each rank checks a shortcut (packing, the shared trunk) on its own rollouts: one rank keeping it
    # while another drops it would make two ranks compute otherwise than one. Two real gloo ranks.
    got = on_two_ranks(_decide, diffs, flags)
    ok, worst, flagged = want
    for rank in range(2):
        (rank_ok, rank_worst), rank_flag = got[rank]
        assert (rank_ok, rank_flag) == (ok, flagged) and rank_worst == pytest.approx(worst)


def test_one_process_decides_on_its_own_measurement():
    assert within_rounding(0.01, torch.bfloat16) == (True, 0.01)
    assert within_rounding(0.01, torch.float32) == (False, 0.01)  # fp32 rounding is ~1e-6
    assert within_rounding(float("nan"), torch.bfloat16) == (False, float("inf"))  # never passes
    assert dist.any_rank(True) and not dist.any_rank(False)
