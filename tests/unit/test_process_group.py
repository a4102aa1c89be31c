"""The process group around a run: barriers that name their device, and run_cli tearing the group down
before exit (exit codes kept), so that NCCL adds no warning lines to a run's output."""

from __future__ import annotations

import importlib.util
import os

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


_MPI_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK",
             "MV2_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")  # fmt: skip


@pytest.fixture
def launcher_env(monkeypatch):
    """Sets a launcher's variables; every rendezvous variable the call under test sets is undone after."""
    for var in (
        *_MPI_VARS,
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.setenv(var, "")  # recorded, so that monkeypatch restores it
        monkeypatch.delenv(var)

    def set_env(env: dict[str, str], mpi4py: bool = True) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if mpi4py else None) if name == "mpi4py" else real(name, *a))  # fmt: skip

    return set_env


@pytest.mark.parametrize(
    ("env", "filled"),
    [
        ({}, True),  # plain `python main.py`
        ({"SLURM_NTASKS": "8"}, True),  # the shell of an 8-task allocation (salloc, sbatch): one process
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, True),  # srun of one task
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, False),  # deepspeed --launcher openmpi
        ({"MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_RANK": "2"}, False),  # mvapich
        ({"PMI_SIZE": "4", "PMI_RANK": "2"}, False),  # mpich / Intel MPI
        ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4"}, False),  # deepspeed --launcher slurm (srun)
    ],
)
def test_an_mpi_launched_rank_is_not_made_a_world_of_one(launcher_env, env, filled):
    # These launchers set no RANK: DeepSpeed finds the ranks through MPI, unless RANK and WORLD_SIZE are
    # already there, and filling them in made every process rank 0 of a world of 1 (N separate runs).
    launcher_env(env)
    dist.ensure_single_process_env()
    assert ("RANK" in os.environ and os.environ.get("WORLD_SIZE") == "1") == filled


def test_an_mpi_launch_without_mpi4py_is_one_clear_line(launcher_env):
    launcher_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, mpi4py=False)
    with pytest.raises(UserError, match=r"OMPI_COMM_WORLD_SIZE=4.*pip install mpi4py"):
        dist.ensure_single_process_env()


def _rollouts_after_seeding(rank: int) -> list[int]:
    """The tokens one rank samples (PPO's plain generator, temperature 1) for the same prompt as its peer,
    with the same weights, after step 3's seeding."""
    from types import SimpleNamespace

    from dschat.generation.plain import PlainGenerator
    from dschat.generation.sampling import SamplingConfig
    from dschat.models.builtin import build_tokenizer
    from tests.unit.test_ppo_trainer import micro_llama

    tokenizer = build_tokenizer()
    model = micro_llama(len(tokenizer), seed=0)  # the same weights on both ranks
    dist.seed_per_rank(3)
    gen = PlainGenerator(
        SimpleNamespace(module=model), tokenizer, SamplingConfig(max_new_tokens=12), zero3=False
    )
    ids = torch.tensor([[40, 41, 42, 43]] * 4)
    return gen.generate(ids, torch.ones_like(ids))[:, 4:].flatten().tolist()


def test_each_rank_samples_its_own_rollouts():
    """Row i of every rank used to get the same uniforms (one seed everywhere): the ranks' samples of a
    prompt were copies, not independent draws."""
    got = on_two_ranks(_rollouts_after_seeding)
    assert got[0] != got[1]


def test_another_runs_threads_on_the_same_cores_are_named(tmp_path, monkeypatch):
    # Two runs that each take every core ran about 40x slower, with no word why. A live process of another
    # run is named; a dead one's entry is removed; a rank of this same run (one rendezvous) is not counted.
    import subprocess
    import sys

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "cpu_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        (tmp_path / str(gone.pid)).write_text("pid1:x 2 0")
        (tmp_path / str(os.getppid())).write_text(f"127.0.0.1:29555 1 {dist.process_start(os.getppid())}")
        assert dist.shared_cpu_warning(2, str(tmp_path)) is None  # 2 ranks x 1 thread on 2 cores: no one else
        assert not (tmp_path / str(gone.pid)).exists()
        assert (
            tmp_path / str(os.getpid())
        ).read_text() == f"127.0.0.1:29555 1 {dist.process_start(os.getpid())}"
        # a live pid whose start time is not the recorded one: a killed run's pid, reused; removed
        (tmp_path / str(other.pid)).write_text(f"pid{other.pid} 2 12345")
        assert dist.shared_cpu_warning(2, str(tmp_path)) is None and not (tmp_path / str(other.pid)).exists()
        (tmp_path / str(other.pid)).write_text(f"pid{other.pid} 2 {dist.process_start(other.pid)}")
        msg = dist.shared_cpu_warning(2, str(tmp_path))
        assert msg and f"pid {other.pid}: 2 threads, this run 2 x 1" in msg and "2 CPU cores" in msg
        monkeypatch.setenv("LOCAL_RANK", "1")  # one line per node, from its local rank 0
        assert dist.shared_cpu_warning(2, str(tmp_path)) is None
        # an inference tool looks without registering: it idles between a chat's turns
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setattr(os, "getpid", lambda: other.pid + 100000)
        assert dist.shared_cpu_warning(2, str(tmp_path), register=False)
        assert not (tmp_path / str(other.pid + 100000)).exists()
    finally:
        other.kill()
        other.wait()


def test_the_inference_tools_warning_keeps_stdout_clean(monkeypatch, capsys):
    # rw_eval --json and a piped chat reply are read from stdout: the shared-CPU warning went there and
    # broke the JSON whenever a step ran beside it
    monkeypatch.setattr(dist, "shared_cpu_warning", lambda **kw: "another dschat run shares ...")
    dist.note_shared_cpu("cpu")
    out, err = capsys.readouterr()
    assert out == "" and err == "warning: another dschat run shares ...\n"
    dist.note_shared_cpu("cuda")  # a GPU run is not slowed by CPU threads
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("rank", "local_rank", "printed"),
    [("0", "0", "error: bad flag\n"), ("1", "1", ""), ("8", "0", "error: rank 8: bad flag\n")],
)
def test_a_user_error_is_printed_once_per_node(monkeypatch, capsys, rank, local_rank, printed):
    """Only rank 0 printed: a user error found on another node alone (its node-local disk, say) ended the
    job with 'exit code 2' and no word. Each node's first rank prints, naming its rank; rank 0 as before."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "16")

    def main() -> int:
        raise UserError("bad flag")

    with pytest.raises(SystemExit):
        run_cli(main)
    assert capsys.readouterr().err == printed
