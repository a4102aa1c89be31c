"""The DeepSpeed launcher's command as train.py builds it (pure: no process starts). Each case is a way the
launcher itself goes wrong with a naive command line (deepspeed/launcher/runner.py, multinode_runner.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

from dschat.launch.launcher import deepspeed_env_lines, launcher, launcher_env, processes, read_hostfile
from dschat.launch.supervise import run_step
from dschat.utils.dist import threads_per_rank
from dschat.utils.errors import UserError
from tests.conftest import ROOT


def args(**kw) -> argparse.Namespace:
    base = dict(deployment_type="single_node", launcher=None, launcher_args=None, nnodes=None, node_rank=None,
                hostfile=None, num_gpus=None, master_port=29500, master_addr=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def after_runner(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("deepspeed.launcher.runner") + 3 :]  # after --master_port N


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    ("visible", "num_gpus", "flags"),
    [
        (None, None, ["--num_gpus", "4"]),
        (None, 2, ["--num_gpus", "2"]),
        # --num_gpus would make the launcher drop CUDA_VISIBLE_DEVICES and use GPUs 0 and 1
        ("2,3", None, []),  # all of them: the launcher turns the variable into --include itself
        ("1,3,5,7", 2, ["--include", "localhost:1,3"]),
    ],
)
def test_single_node_keeps_to_the_visible_gpus(four_gpus, monkeypatch, visible, num_gpus, flags):
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible.split(",")))
    assert after_runner(launcher(args(num_gpus=num_gpus))) == ["--hostfile", os.devnull, *flags]


def test_single_node_ignores_a_hostfile_at_the_runners_default_path(four_gpus, monkeypatch, tmp_path):
    # DeepSpeed's runner reads /job/hostfile when given no --hostfile: where a cluster image has one, a
    # single_node run would have gone to the hosts listed there.
    from deepspeed.launcher import runner

    default = tmp_path / "job_hostfile"
    default.write_text("node-a slots=8\nnode-b slots=8\n")
    monkeypatch.setattr(runner, "DLTS_HOSTFILE", str(default))
    parsed = runner.parse_args([*after_runner(launcher(args())), "step.py"])
    assert runner.fetch_hostfile(parsed.hostfile) is None  # local resources only
    assert runner.fetch_hostfile(runner.parse_args(["step.py"]).hostfile) is not None  # the trap itself


def torchrun_args(**kw) -> argparse.Namespace:
    return args(
        deployment_type="multi_node", launcher="torchrun", nnodes=2, node_rank=0, master_addr="n0", **kw
    )


def test_torchrun_cpu_ranks_split_the_cores_instead_of_one_thread_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("dschat.launch.launcher.cpu_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launcher_env(torchrun_args(num_gpus=4)) == {"OMP_NUM_THREADS": "4"}
    assert launcher_env(torchrun_args()) == {"OMP_NUM_THREADS": "1"}  # one rank per core
    assert launcher_env(torchrun_args(num_gpus=1)) == {}  # one rank: torchrun sets nothing, torch decides
    # the DeepSpeed launcher: the ranks split the cores themselves; on one node they stay on the CPU
    assert launcher_env(args()) == {"DS_ACCELERATOR": "cpu"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert launcher_env(torchrun_args(num_gpus=4)) == {}


def test_gpu_ranks_get_no_variables(four_gpus):
    assert launcher_env(args()) == {} and launcher_env(torchrun_args(num_gpus=4)) == {}


@pytest.mark.parametrize(("accelerator", "want"), [("cpu", ""), (None, "0,1")])
def test_cpu_ranks_hide_the_gpus_the_deepspeed_launcher_shows_them(accelerator, want):
    """DeepSpeed's launcher gives CPU ranks CUDA_VISIBLE_DEVICES=0,1; with DS_ACCELERATOR=cpu (train.py's
    launcher_env) importing dschat hides them again, before torch is asked for CUDA."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    if accelerator:
        env["DS_ACCELERATOR"] = accelerator
    code = "import dschat, os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == repr(want), out.stderr


def test_ranks_on_one_machine_split_its_cores_evenly(monkeypatch):
    assert threads_per_rank(3, cores=16) == 5  # 16 // 3: the remainder stays idle rather than oversubscribed
    assert threads_per_rank(4, cores=2) == 1  # more ranks than cores: one thread each, never zero
    monkeypatch.setattr("dschat.utils.dist.cpu_cores", lambda: 12)
    assert threads_per_rank(2) == 6  # by default this process's own cores


def test_gpu_uuids_in_cuda_visible_devices_are_one_line(four_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a,GPU-77b1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match=r"CUDA_VISIBLE_DEVICES=GPU-8f3a,GPU-77b1.*indices"):
        launcher(args())


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node-a slots=2\n")  # one remote host: the runner would launch on this machine
    return str(path)


def test_multi_node_flags_per_backend(hostfile):
    pdsh = after_runner(launcher(args(deployment_type="multi_node", hostfile=hostfile)))
    assert pdsh == ["--hostfile", hostfile, "--launcher", "pdsh", "--force_multi"]
    mpi = after_runner(launcher(args(deployment_type="multi_node", hostfile=hostfile, launcher="openmpi")))
    # only pdsh needs ssh; without an address the runner would ssh to node-a to ask for one
    assert mpi == ["--hostfile", hostfile, "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
                   "--master_addr", "node-a"]  # fmt: skip
    slurm = after_runner(
        launcher(
            args(deployment_type="multi_node", hostfile=hostfile, launcher="slurm", launcher_args="-p gpu")
        )
    )
    assert slurm[-1:] == ["--launcher_args=-p gpu --kill-on-bad-exit=1"]  # a dead rank ends the job


@pytest.mark.parametrize("extra", [None, "--exclusive", "-p gpu"])
def test_slurm_launcher_args_reach_deepspeeds_runner_as_one_value(hostfile, extra):
    """DeepSpeed's runner parses its own command line: a value that starts with a dash, given as a
    separate word, is read as an option (srun's --kill-on-bad-exit=1, added by default, always is)."""
    from deepspeed.launcher.runner import parse_args

    cmd = launcher(
        args(deployment_type="multi_node", hostfile=hostfile, launcher="slurm", launcher_args=extra)
    )
    runner = cmd[cmd.index("deepspeed.launcher.runner") + 1 :]
    parsed = parse_args([*runner, "train.py"])
    assert parsed.launcher_args == f"{extra or ''} --kill-on-bad-exit=1".strip()


def test_launcher_args_with_torchrun_is_one_line():
    """torchrun takes no backend arguments: --launcher-args would be dropped silently."""
    with pytest.raises(UserError, match=r"--launcher-args.*torchrun"):
        launcher(args(deployment_type="multi_node", launcher="torchrun", launcher_args="--x", nnodes=2, node_rank=0,
                      master_addr="10.0.0.1", master_port=29500))  # fmt: skip


@pytest.mark.parametrize("backend", ["openmpi", "mvapich", "mpich", "impi"])
def test_num_gpus_with_a_backend_that_refuses_it_is_one_line(hostfile, backend):
    with pytest.raises(UserError, match=rf"--num-gpus with --launcher {backend}.*slots"):
        launcher(args(deployment_type="multi_node", hostfile=hostfile, launcher=backend, num_gpus=2))


def test_more_gpus_than_a_hosts_slots_is_one_line(tmp_path):
    """DeepSpeed's runner starts --num_gpus ranks on every host without checking its slots."""
    path = tmp_path / "hosts"
    path.write_text("node-a slots=8\nnode-b slots=2\n")
    with pytest.raises(UserError, match=r"--num-gpus 4: host node-b has 2 slots"):
        launcher(args(deployment_type="multi_node", hostfile=str(path), num_gpus=4))
    # planned as if every host had the fewest slots: per-device estimates above the need, not below
    assert processes(args(deployment_type="multi_node", hostfile=str(path))) == (2, 2)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"master_port": 99999}, "--master-port 99999: must be a port number"),
     ({"deployment_type": "single_gpu", "master_addr": "x", "master_port": None}, "--master-addr needs"),
     ({"deployment_type": "single_gpu"}, "--master-port needs")],
)  # fmt: skip
def test_rendezvous_flags_that_would_be_dropped_or_are_out_of_range_are_one_line(kw, needle):
    with pytest.raises(UserError, match=needle):
        launcher(args(**kw))


@pytest.mark.parametrize(
    ("text", "needle"),
    [("node-a slots = 2\n", "line 1"), ("node-a slots=2\nnode-a slots=2\n", "node-a is listed twice"),
     # 0 divided the memory plan by zero, a huge count overflowed it (tracebacks, --dry-run included)
     ("node-a slots=2\nnode-b slots=0\n", "line 2: slots must be in 1 .. 4096, got 0"),
     ("node-a slots=99999999999\n", "line 1: slots must be in 1 .. 4096"),
     (b"node-a slots=2\n\xff\n", "not UTF-8 text")],
)  # fmt: skip
def test_a_hostfile_deepspeed_would_refuse_is_one_line(tmp_path, text, needle):
    path = tmp_path / "hosts"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(UserError, match=needle):
        read_hostfile(str(path))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"num_gpus": -4}, "--num-gpus -4: must be in 1 .. 4096"),
     ({"num_gpus": 0}, "--num-gpus 0: must be in 1 .. 4096"),  # was replaced by the detected count
     ({"num_gpus": 99999999999}, "--num-gpus 99999999999: must be in 1 .. 4096"),
     ({"deployment_type": "single_gpu", "num_gpus": 4, "master_port": None}, "--num-gpus needs"),
     ({"deployment_type": "multi_node", "launcher": "torchrun", "nnodes": -3}, "--nnodes -3: must be at least 1"),
     ({"deployment_type": "multi_node", "launcher": "torchrun", "nnodes": 2, "node_rank": 7}, "--node-rank 7 must be"),
     ({"deployment_type": "multi_node", "nnodes": 5}, "--nnodes and --node-rank need --launcher torchrun"),
     ({"nnodes": 4}, "--nnodes needs --deployment-type multi_node")],
)  # fmt: skip
def test_deployment_flags_are_checked_before_any_plan_on_any_machine(kw, needle):
    """--estimate-memory plans a cluster from any machine, before the launcher's own checks: it printed
    '1 node x -4 CPU processes' and negative GiB, and planned --nnodes 4 as one node without a word."""
    from dschat.launch.launcher import check_deployment_flags

    with pytest.raises(UserError, match=needle):
        check_deployment_flags(args(**kw))


def test_a_memory_plan_of_nnodes_needs_no_launcher():
    """The README plans a cluster with --estimate-memory --deployment-type multi_node --nnodes 8: only a
    real run needs torchrun for --nnodes (the DeepSpeed launcher reads --hostfile)."""
    from dschat.launch.launcher import check_deployment_flags

    check_deployment_flags(args(deployment_type="multi_node", nnodes=8, num_gpus=8, estimate_memory=True))
    with pytest.raises(UserError, match="--nnodes and --node-rank need --launcher torchrun"):
        check_deployment_flags(args(deployment_type="multi_node", nnodes=8, num_gpus=8))


def test_a_run_started_under_nohup_outlives_a_hang_up(tmp_path):
    """nohup ignores SIGHUP so that a run outlives the session; the step supervisor made a hang-up stop
    the run anyway (it installed its own handler over the ignored signal)."""
    code = (
        "import os, signal, time\n"
        "from dschat.launch import supervise\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does\n"
        "with supervise._terminate_as_interrupt():\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "    time.sleep(0.5)\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-800:]


def test_a_hostfile_that_is_a_directory_says_so(tmp_path):
    from dschat.launch.launcher import check_deployment_flags

    with pytest.raises(UserError, match="is a directory, not a hostfile"):
        check_deployment_flags(args(deployment_type="multi_node", hostfile=str(tmp_path)))


def test_the_env_file_for_other_nodes_merges_the_users_and_forwards_the_steps_variables(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n\n")
    env = {
        "DSCHAT_DIST_TIMEOUT": "600",
        "HF_HUB_OFFLINE": "1",
        "DSCHAT_X": "a\nb",
        "HOME": "/root",
        "PATH": "/bin",
    }
    assert deepspeed_env_lines(env, home, cwd) == [
        "NCCL_IB_DISABLE=1",
        "DSCHAT_DIST_TIMEOUT=600",
        "HF_HUB_OFFLINE=1",
    ]


def test_a_remote_step_reads_its_variables_from_a_private_file_that_is_removed_after(tmp_path):
    # pdsh starts every rank through ssh: only the runner's env file carries train.py's settings there
    show = "import os; p = os.environ['DS_ENV_FILE']; print(p); print(open(p).read())"
    code, _ = run_step([sys.executable, "-c", show], tmp_path / "log", append=False,
                       env={"DSCHAT_DIST_TIMEOUT": "600"}, remote=True)  # fmt: skip
    lines = (tmp_path / "log").read_text().splitlines()
    assert code == 0 and "DSCHAT_DIST_TIMEOUT=600" in lines and "DSCHAT_LOG_CAPTURED=1" in lines
    assert not Path(lines[1]).exists()


@pytest.mark.parametrize(("remote", "report"), [(True, ""), (False, "rank 1 (pid 999999999) ended first")])
def test_a_remote_steps_spawn_lines_name_no_rank(tmp_path, remote, report):
    # pdsh brings back other nodes' spawn lines: their pids, absent here, looked like ranks that had ended
    spawn = "node-b: process 999999999 spawned with command: ['python', 'main.py', '--local_rank=1']"
    code, failed = run_step([sys.executable, "-c", f"import time; print({spawn!r}, flush=True); time.sleep(1); "
                             "raise SystemExit(1)"], tmp_path / "log", append=False, remote=remote)  # fmt: skip
    assert code == 1 and failed.startswith(report)


# A stand-in for the DeepSpeed launcher: rank 1 dies with 13, rank 0's collective fails a moment later with
# 1, and the launcher, which polls its ranks once a second in set order, exits with the code of whichever
# failed rank it happens to see first (here: rank 0's 1, as it did in a CI run).
LAUNCHER_THAT_REPORTS_THE_WRONG_RANK = """
import subprocess, sys, time
def spawn(code, rank):
    p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    print(f"process {p.pid} spawned with command: ['main.py', '--local_rank={rank}']", flush=True)
    return p
dies = spawn(13, 1)
time.sleep(1.0)  # rank 1 lies dead and unreaped, as between two of the launcher's polls
fails_after = spawn(1, 0)
fails_after.wait()
dies.wait()
raise SystemExit(fails_after.returncode)
"""


def test_a_failed_step_reports_the_exit_code_of_the_rank_that_ended_first(tmp_path):
    code, failed = run_step([sys.executable, "-c", LAUNCHER_THAT_REPORTS_THE_WRONG_RANK], tmp_path / "log",
                            append=False)  # fmt: skip
    assert code == 13, (code, failed)
    assert failed.startswith("rank 1 (pid ") and ", exit code 13) ended first;" in failed, failed


def test_a_rank_that_finished_is_not_named_and_a_killed_one_is_named_with_its_signal(tmp_path):
    # rank 0 finishes cleanly first; rank 1 is then killed (as by the OOM killer); the launcher exits 1
    launcher = """
import subprocess, sys, time
def spawn(code, rank):
    p = subprocess.Popen([sys.executable, "-c", code])
    print(f"process {p.pid} spawned with command: ['main.py', '--local_rank={rank}']", flush=True)
    return p
done = spawn("pass", 0)
time.sleep(1.0)
killed = spawn("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 1)
time.sleep(1.0)
done.wait(); killed.wait()
raise SystemExit(1)
"""
    code, failed = run_step([sys.executable, "-c", launcher], tmp_path / "log", append=False)
    assert code == -signal.SIGKILL, (code, failed)
    assert failed.startswith("rank 1 (pid ") and ", killed by SIGKILL) ended first;" in failed, failed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["kill-INT", "kill-TERM"])
def test_stopping_train_py_stops_the_steps_whole_process_tree(tmp_path, signum):
    # The DeepSpeed runner forwards no signal on one node: its ranks kept training after train.py went
    spawn = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
             " print(c.pid, flush=True); time.sleep(60)")  # fmt: skip
    # A signal to train.py alone, to its main thread: sent with os.kill from the timer's thread, Linux may
    # deliver it to that thread, and the main thread, blocked reading the step's output, then sees it only
    # when the step ends. Python's own Ctrl-C handler, whatever an earlier test in this worker set.
    main = threading.main_thread().ident
    threading.Timer(3.0, signal.pthread_kill, (main, signum)).start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_step([sys.executable, "-c", spawn], tmp_path / "log", append=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    rank = int((tmp_path / "log").read_text().splitlines()[1])  # the grandchild: a rank of the launcher
    with contextlib.suppress(psutil.NoSuchProcess):  # gone, or dead and waiting to be reaped
        assert psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(
    "signals",
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM), (signal.SIGHUP,)],
    ids=["INT-twice", "TERM-twice", "HUP"],
)
def test_a_second_interrupt_or_a_hangup_still_stops_a_rank_that_ignores_sigint(
    tmp_path, monkeypatch, signals
):
    """A rank blocked in a collective does not act on SIGINT, so the stop escalates to SIGTERM after a
    grace period. A second Ctrl-C within it raised inside the escalation, which then never sent SIGTERM:
    the rank trained on, alone. A hang-up (a dropped ssh session) ended train.py at once, the same way."""
    from dschat.launch import supervise

    monkeypatch.setattr(supervise, "STOP_GRACE_SECONDS", 1.0)
    spawn = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
             "'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)']);"
             " print(c.pid, flush=True); time.sleep(60)")  # fmt: skip
    main = threading.main_thread().ident
    for i, signum in enumerate(signals):
        threading.Timer(3.0 + 0.5 * i, signal.pthread_kill, (main, signum)).start()
    # the signals' usual dispositions, whatever this test runs under (CI started under nohup ignores
    # SIGHUP, and an ignored signal stays ignored by design: test_a_run_started_under_nohup...)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_DFL),
                signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL)}  # fmt: skip
    try:
        with pytest.raises(KeyboardInterrupt):
            run_step([sys.executable, "-c", spawn], tmp_path / "log", append=False)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    rank = int((tmp_path / "log").read_text().splitlines()[1])
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


def test_a_rank_killed_by_a_signal_without_a_name_is_still_reported():
    from dschat.launch.supervise import RankWatch

    watch = RankWatch(local=False)
    watch.together, watch.codes = [(1, 4242)], {4242: -35}  # SIGRTMIN+1 and above have no Signals name
    assert (
        watch.report()
        == "rank 1 (pid 4242, killed by signal 35) ended first; the launcher then stopped the other ranks"
    )


def test_master_addr_on_a_single_node_is_one_line():
    """The runner sets MASTER_ADDR=127.0.0.1 on one node whatever it is given: the flag would be dropped."""
    with pytest.raises(UserError, match=r"--master-addr needs --deployment-type multi_node"):
        launcher(args(deployment_type="single_node", master_addr="10.0.0.1"))


def test_a_steps_log_beside_an_earlier_runs_takes_its_name_only_when_the_step_begins_its_outputs(tmp_path):
    """An earlier training.log stays until the step's outputs begin (adopt_pending_log); the failure line
    names the file written; a refused attempt's file left behind is not named by a later run."""
    from dschat.launch.supervise import step_log

    log = tmp_path / "training.log"
    log.write_text("earlier\n")
    adopt = "from dschat.launch.supervise import adopt_pending_log; adopt_pending_log(); print('after')"
    refuse = "import sys; print('refused'); sys.exit(2)"
    env = {"PYTHONPATH": str(ROOT)}
    assert run_step([sys.executable, "-c", refuse], log, append=False, env=env)[0] == 2
    assert log.read_text() == "earlier\n" and "refused" in (tmp_path / "training.attempt.log").read_text()
    assert step_log(log) == f"{tmp_path / 'training.attempt.log'} (training.log keeps the earlier run's)"
    # a resume appends to training.log: the refused attempt's file is stale, gone, and not named
    assert run_step([sys.executable, "-c", refuse], log, append=True, env=env)[0] == 2
    assert not (tmp_path / "training.attempt.log").exists() and step_log(log) == str(log)
    assert log.read_text().startswith("earlier\n") and "refused" in log.read_text()
    # a step that begins its outputs: its log (written on after the rename) replaces the earlier one
    assert run_step([sys.executable, "-c", adopt], log, append=False, env=env)[0] == 0
    assert "after" in log.read_text() and "earlier" not in log.read_text()
    assert not (tmp_path / "training.attempt.log").exists()
