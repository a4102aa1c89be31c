"""The ``train.py`` command line: help, and flag combinations refused with one line before anything runs."""

from __future__ import annotations

import pytest

from tests.integration.helpers import error_line, train_py


def test_help():
    proc = train_py("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--step", "--deployment-type", "--actor-model", "--num-gpus", "--hostfile", "--output-dir"):
        assert flag in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--deployment-type", "single_gpu", "--hostfile", "hosts.txt"], ["--hostfile", "multi_node"]),
        (["--deployment-type", "multi_node"], ["multi_node", "--hostfile"]),
        (
            ["--deployment-type", "multi_node", "--hostfile", "/no/such/hostfile"],
            ["/no/such/hostfile", "not found"],
        ),
        (["--deployment-type", "single_gpu", "--num-gpus", "2"], ["--num-gpus", "single_node"]),
        (["--actor-zero-stage", "4"], ["--actor-zero-stage", "4"]),
        (["--no-such-flag"], ["--no-such-flag"]),
        (["--step", "4"], ["--step", "4"]),
        # flags no step of the job reads were accepted and ignored
        (["--reward-model", "builtin:micro-llama"], ["--reward-model", "steps 2 and 3", "--step 1"]),
        (["--reward-zero-stage", "3"], ["--reward-zero-stage", "steps 2 and 3", "--step 1"]),
        (["--step", "2", "--actor-zero-stage", "3"], ["--actor-zero-stage", "steps 1 and 3", "--step 2"]),
    ],
    ids=[
        "hostfile-single-gpu",
        "multi-node-no-hostfile",
        "hostfile-missing",
        "num-gpus-single-gpu",
        "zero-stage-4",
        "unknown-flag",
        "no-step-4",
        "reward-model-step-1",
        "reward-zero-stage-step-1",
        "actor-zero-stage-step-2",
    ],
)
def test_bad_flag_combinations_are_one_line(tmp_path, args, needles):
    step = [] if "--step" in args else ["--step", "1"]  # a flag given twice is itself refused
    proc = train_py(*step, "--output-dir", str(tmp_path), *args)
    error_line(proc, *needles)
    assert not (tmp_path / "step1").exists()


@pytest.mark.parametrize("spelling", [["--resume"], ["--", "--resume"]], ids=["train-py-flag", "step-flag"])
def test_an_unfinished_step_resumes_with_either_spelling_of_resume(tmp_path, spelling):
    """train.py's --resume and the step's own after -- are one request: both pass the output-directory check
    and reach the step once (the step's --resume used to be refused with 'pass --resume to continue it')."""
    import shlex

    ckpt = tmp_path / "step1" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step5\n")
    common = ["--dry-run", "--step", "1", "--actor-model", "builtin:micro-llama", "--preset", "none",
              "--output-dir", str(tmp_path)]  # fmt: skip
    error_line(train_py(*common), "holds checkpoints of an unfinished run", "--resume")
    proc = train_py(*common, *spelling)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("==> step 1 ("))
    assert shlex.split(line.split(": ", 1)[1]).count("--resume") == 1


def _job_dir(tmp_path, finished=(), checkpointed=()):
    """An output directory of a job that stopped: steps in ``finished`` wrote their summary, steps in
    ``checkpointed`` saved a checkpoint and no summary."""
    for n in finished:
        (tmp_path / f"step{n}").mkdir(parents=True)
        (tmp_path / f"step{n}" / "summary.json").write_text("{}")
    for n in checkpointed:
        ckpt = tmp_path / f"step{n}" / "checkpoints"
        ckpt.mkdir(parents=True)
        (ckpt / "latest").write_text("step5\n")


JOB = ["--dry-run", "--actor-model", "builtin:micro-llama", "--preset", "none"]


def test_resume_continues_a_job_where_it_stopped(tmp_path):
    """A three-step job stopped in step 2: --resume keeps step 1 (finished: not run, not overwritten),
    resumes step 2 from its checkpoint and starts step 3 afresh (no --resume: it has nothing to resume)."""
    import shlex

    _job_dir(tmp_path, finished=[1], checkpointed=[2])
    error_line(train_py(*JOB, "--output-dir", str(tmp_path)), "step1", "holds a finished run")
    proc = train_py(*JOB, "--output-dir", str(tmp_path), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert "==> step 1 (supervised fine-tuning): finished, kept (--resume)" in out
    assert not any(x.startswith("==> step 1 (") and "main.py" in x for x in out)
    cmds = {n: next(x for x in out if x.startswith(f"==> step {n} (") and "main.py" in x) for n in (2, 3)}
    assert shlex.split(cmds[2].split(": ", 1)[1]).count("--resume") == 1
    assert "--resume" not in shlex.split(cmds[3].split(": ", 1)[1])
    assert (tmp_path / "step1" / "summary.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("finished", "checkpointed", "needles"),
    [
        ((), (), ["--resume", "nothing to resume"]),
        ((2,), (1,), ["--resume", "step 2 is finished but step 1 before it is not finished", "--overwrite"]),
        (
            (1,),
            (2, 3),
            ["--resume", "step 3 has checkpoints but step 2 before it is not finished", "--overwrite"],
        ),
    ],
    ids=["nothing-to-resume", "finished-after-unfinished", "checkpointed-after-unfinished"],
)
def test_resume_refuses_a_job_it_cannot_continue(tmp_path, finished, checkpointed, needles):
    _job_dir(tmp_path, finished=finished, checkpointed=checkpointed)
    error_line(train_py(*JOB, "--output-dir", str(tmp_path), "--resume"), *needles)


def test_resume_and_overwrite_together_are_refused(tmp_path):
    """Both flags reach the steps' checks, which refuse them (a first version of the multi-step resume
    passed --overwrite alone, and every step would have started over): nothing is removed."""
    _job_dir(tmp_path, finished=[1], checkpointed=[2])
    error_line(train_py(*JOB, "--output-dir", str(tmp_path), "--resume", "--overwrite"), "--resume")
    assert (tmp_path / "step1" / "summary.json").exists()
    assert (tmp_path / "step2" / "checkpoints" / "latest").exists()
