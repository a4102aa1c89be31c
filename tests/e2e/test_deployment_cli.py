"""train.py's deployment, preset and memory-planning options as a user types them (no training runs:
--dry-run and --estimate-memory), the preset files, and the SLURM / Kubernetes files."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from dschat.launch import presets
from dschat.launch.supervise import RankWatch
from tests.conftest import ROOT, cpu_ranks_env
from tests.integration.helpers import assert_ok, error_line, train_py

PRESETS = sorted((ROOT / "configs" / "presets").glob("*.yaml"))


@pytest.fixture(scope="module")
def train():
    import train as module  # ROOT is on sys.path (the tests package's parent)

    return module


def launch_line(stdout: str, step: int) -> list[str]:
    line = next(x for x in stdout.splitlines() if x.startswith(f"==> step {step} ("))
    return shlex.split(line.split(": ", 1)[1])


def step_options(train, step: int, cmd: list[str]) -> dict:
    """The step's options as its own parser reads the printed command."""
    import dataclasses

    entry = next(i for i, a in enumerate(cmd) if a.endswith("main.py"))
    out = {}
    for group in train.parse_step(train.STEPS[step], cmd[entry + 1 :]):
        out.update(dataclasses.asdict(group))
    return out


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_parses_through_every_step_parser(train, path):
    from dschat.models import shapes as S

    preset = presets.read_preset(path)
    for step in (*train.STEPS.values(), train.DPO_STEP):  # SystemExit(2) on a bad flag or value
        assert train.parse_step(step, presets.preset_flags(preset, step.dir_name))
    # its models plan offline, and --actor-model NAME with its deployment type selects this very file
    for key in ("model", "reward_model"):
        if preset.get(key):
            S.shape_from_config(S.load_model_config(preset[key])[0])
    if preset.get("deployment_type"):
        found, _ = presets.preset_for_model(preset["model"], preset["deployment_type"])
        assert found == path


def test_preset_implied_by_the_actor_model_and_overridden_by_flags(train, tmp_path):
    proc = train_py("--dry-run", "--step", "1", "--actor-model", "facebook/opt-1.3b", "--actor-zero-stage", "2",
                    "--output-dir", str(tmp_path), "--", "--max_seq_len", "256")  # fmt: skip
    assert_ok(proc)
    assert (
        "==> preset opt-1.3b-single_gpu (implied by --actor-model facebook/opt-1.3b): deployment single_gpu"
        in (proc.stdout)
    )
    opts = step_options(train, 1, launch_line(proc.stdout, 1))
    # the preset's values, except where a flag of this command says otherwise
    assert opts["lora_dim"] == 128 and opts["gradient_accumulation_steps"] == 8
    assert opts["zero_stage"] == 2 and opts["max_seq_len"] == 256
    assert opts["model_name_or_path"] == "facebook/opt-1.3b"
    assert not (tmp_path / "step1").exists()

    # the deployment type picks among a model's presets; --preset none turns presets off
    proc = train_py("--dry-run", "--step", "1", "--actor-model", "facebook/opt-1.3b", "--deployment-type", "single_node",
                    "--num-gpus", "2", "--output-dir", str(tmp_path), env=cpu_ranks_env())  # fmt: skip
    assert_ok(proc)
    assert "==> preset opt-1.3b-single_node" in proc.stdout
    assert "deepspeed.launcher.runner" in " ".join(launch_line(proc.stdout, 1))
    proc = train_py("--dry-run", "--step", "1", "--actor-model", "builtin:micro-llama", "--preset", "none",
                    "--output-dir", str(tmp_path))  # fmt: skip
    assert_ok(proc)
    assert "==> preset" not in proc.stdout


# ---------------------------------------------------------------------------------------------- memory
def test_estimate_memory_prints_every_choice_and_the_pick(tmp_path):
    from dschat import memory as M
    from dschat.models import shapes as S

    proc = train_py("--estimate-memory", "--step", "1", "--actor-model", "builtin:micro-llama", "--deployment-type",
                    "single_node", "--num-gpus", "4", "--device-memory", "80", "--cpu-memory", "512", "--",
                    "--max_seq_len", "64", "--per_device_train_batch_size", "4", "--dtype", "bf16")  # fmt: skip
    assert_ok(proc)
    shape = S.shape_from_config(S.load_model_config("builtin:micro-llama")[0])
    hw = M.Hardware(4, 1, True, 80 * M.GIB, 512 * M.GIB)
    work = M.TrainWorkload(shape, 4, 64, 2)
    rows = re.findall(r"^\s+(\d)\s+(yes|no)\s+(yes|no)\s+([\d.]+)\s+([\d.]+)\s+(yes|no)", proc.stdout, re.M)
    assert len(rows) == len(M.CANDIDATES)
    for stage, offload, ckpt, dev, cpu, fits in rows:
        e = M.estimate_train(work, M.Choice(int(stage), offload == "yes", ckpt == "yes"), hw)
        assert float(dev) == pytest.approx(e.device / M.GIB, abs=0.006)
        assert float(cpu) == pytest.approx(e.cpu_node / M.GIB, abs=0.006)
        assert fits == "yes"
    assert "choice: ZeRO-0, no offload, gradient checkpointing off: the fastest that fits" in proc.stdout
    assert "1 node x 4 GPUs (80.00 GiB each)" in proc.stdout


def test_estimate_memory_of_step_3_from_the_built_in_table(tmp_path):
    proc = train_py("--estimate-memory", "--step", "3", "--actor-model", "facebook/opt-13b", "--num-gpus", "8",
                    "--device-memory", "80", "--output-dir", str(tmp_path))  # fmt: skip
    assert_ok(proc)
    assert "actor: facebook/opt-13b, 12.85B parameters" in proc.stdout
    assert "critic: facebook/opt-350m, 331.2M parameters" in proc.stdout  # the preset's reward model
    assert (
        "fixed by the flags (yours or the preset's): zero_stage=3" in proc.stdout
    )  # the preset's --actor_zero_stage 3
    assert re.search(
        r"actor states [\d.]+ \+ critic states [\d.]+ \+ gradient buckets [\d.]+ \+ reference [\d.]+ \+ "
        r"reward model",
        proc.stdout,
    )  # ZeRO-3's two trained engines each keep a reduce bucket of 5e7 bf16 elements: 0.19 GiB


def test_the_readmes_cluster_plan_from_a_machine_without_gpus(tmp_path):
    """The README's example plans 8 nodes x 8 GPUs of 80 GiB with --nnodes (no launcher needed to plan),
    and judges no CPU RAM by this machine's."""
    proc = train_py("--estimate-memory", "--step", "3", "--actor-model", "facebook/opt-66b", "--deployment-type",
                    "multi_node", "--nnodes", "8", "--num-gpus", "8", "--device-memory", "80",
                    "--output-dir", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert_ok(proc)
    assert "8 nodes x 8 GPUs (80.00 GiB each)" in proc.stdout and "nothing fits" not in proc.stdout


def test_estimate_memory_of_dpo_plans_the_policy_on_pairs(tmp_path):
    # DPO's step 2 is the step-1 policy (LM head) on chosen + rejected, not the reward model
    proc = train_py("--estimate-memory", "--algorithm", "dpo", "--step", "2", "--actor-model", "facebook/opt-1.3b",
                    "--preset", "none", "--device-memory", "80", "--output-dir", str(tmp_path))  # fmt: skip
    assert_ok(proc)
    assert "step 2 (DPO)" in proc.stdout
    assert "model: facebook/opt-1.3b, 1.32B parameters" in proc.stdout  # the policy's start, with its LM head
    assert "pairs (chosen + rejected)" in proc.stdout and "<- choice" in proc.stdout


def test_dpo_with_a_preset_that_has_no_dpo_section_is_one_line(tmp_path):
    """The OPT preset (implied by --actor-model) configures steps 1-3 only: DPO would run on the step's
    defaults (built-in data, no LoRA) beside a step 1 on the preset's data."""
    proc = train_py("--dry-run", "--algorithm", "dpo", "--actor-model", "facebook/opt-1.3b", "--output-dir",
                    str(tmp_path))  # fmt: skip
    error_line(proc, "--algorithm dpo", "opt-1.3b-single_gpu", "no step2_dpo section")
    assert not (tmp_path / "step1").exists()


def test_estimate_memory_of_an_unknown_offline_model_is_one_line():
    error_line(train_py("--estimate-memory", "--step", "1", "--actor-model", "no-org/no-such-model"),
               "--actor-model no-org/no-such-model", "offline")  # fmt: skip


def test_the_plan_adds_what_fits_and_explicit_flags_win(train, tmp_path):
    """llama-100m on a GPU just too small for ZeRO-0 without gradient checkpointing: the plan adds
    --gradient_checkpointing; with --zero_stage 0 --offload... given by the user, theirs stand."""
    from dschat import memory as M
    from dschat.models import shapes as S

    shape = S.shape_from_config(S.load_model_config("builtin:llama-100m")[0])
    work = M.TrainWorkload(shape, 16, 512, 2)
    hw = M.Hardware(1, 1, True, None, None)
    plain, ckpt = (M.estimate_train(work, M.Choice(0, False, g), hw).device for g in (False, True))
    assert ckpt < plain
    gib = f"{(ckpt / M.FIT_FRACTION + plain / M.FIT_FRACTION) / 2 / M.GIB:.3f}"  # between the two
    common = ["--dry-run", "--step", "1", "--actor-model", "builtin:llama-100m", "--device-memory", gib,
              "--cpu-memory", "64", "--output-dir", str(tmp_path), "--", "--dtype", "bf16",
              "--per_device_train_batch_size", "16", "--max_seq_len", "512"]  # fmt: skip
    proc = train_py(*common)
    assert_ok(proc)
    opts = step_options(train, 1, launch_line(proc.stdout, 1))
    assert opts["gradient_checkpointing"] is True and opts["zero_stage"] == 0 and opts["offload"] is False
    assert "==> memory plan, step 1: ZeRO-0, no offload, gradient checkpointing on, picked (adds --gradient_checkpointing)" in proc.stdout  # fmt: skip

    proc = train_py(*common, "--zero_stage", "2", "--offload")
    assert_ok(proc)
    opts = step_options(train, 1, launch_line(proc.stdout, 1))
    assert opts["zero_stage"] == 2 and opts["offload"] is True


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--actor-zero-stage", "2", "--", "--zero_stage", "3"], ["conflicting", "--actor-zero-stage 2", "--zero_stage 3"]),
        (["--", "--zero_stage", "0", "--offload"], ["--offload", "--zero_stage"]),
        (["--deployment-type", "multi_node", "--launcher", "torchrun"],
         ["--nnodes", "--node-rank", "--master-addr", "--master-port"]),
        (["--deployment-type", "multi_node", "--launcher", "torchrun", "--nnodes", "2", "--node-rank", "2",
          "--master-addr", "10.0.0.1", "--master-port", "29500"], ["--node-rank 2"]),
        (["--nnodes", "2"], ["--nnodes", "multi_node"]),
        (["--deployment-type", "single_node", "--launcher", "openmpi"], ["--launcher", "multi_node"]),
        (["--preset", "no-such-preset"], ["--preset no-such-preset", "builtin-tiny"]),
        (["--device-memory", "0"], ["--device-memory"]),
        (["--device-memory", "nan"], ["--device-memory", "nan"]),
        (["--dist-timeout", "inf"], ["--dist-timeout", "inf"]),
        # a step flag shortened: the planner, which matches flags as spelt, added --zero_stage beside it
        (["--", "--zero", "0"], ["unrecognized arguments: --zero"]),
    ],
    ids=["zero-stage-twice", "offload-zero0", "torchrun-missing", "node-rank-range", "nnodes-single-gpu",
         "launcher-single-node", "unknown-preset", "device-memory-0", "device-memory-nan", "dist-timeout-inf",
         "abbreviated-step-flag"],
)  # fmt: skip
def test_bad_deployment_flags_are_one_line(tmp_path, args, needles):
    proc = train_py(
        "--step", "1", "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path), *args
    )
    error_line(proc, *needles)
    assert not (tmp_path / "step1").exists()


def test_bad_hostfile_and_preset_files_name_the_line_or_key(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# nodes\nnode-a slots=8\nnode-b eight\n")
    error_line(train_py("--deployment-type", "multi_node", "--hostfile", str(hosts), "--output-dir", str(tmp_path)),
               str(hosts), "line 3", "node-b eight")  # fmt: skip
    preset = tmp_path / "p.yaml"
    preset.write_text("model: builtin:micro-llama\nstep4: {}\n")
    error_line(train_py("--preset", str(preset), "--output-dir", str(tmp_path)), str(preset), "'step4'")


def test_multi_node_commands(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    proc = train_py("--dry-run", "--step", "1", "--actor-model", "builtin:micro-llama", "--deployment-type",
                    "multi_node", "--hostfile", str(hosts), "--launcher", "openmpi", "--launcher-args", "-x FOO=1",
                    "--node-local-storage", "--output-dir", str(tmp_path))  # fmt: skip
    assert_ok(proc)
    cmd = launch_line(proc.stdout, 1)
    i = cmd.index("deepspeed.launcher.runner")
    assert cmd[i + 1 : i + 3] == ["--master_port", cmd[i + 2]]
    assert cmd[i + 3 :][:9] == ["--hostfile", str(hosts), "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
                                "--master_addr", "node-a", "--launcher_args=-x FOO=1"]  # fmt: skip
    assert "--node_local_storage" in cmd

    proc = train_py("--dry-run", "--step", "1", "--actor-model", "builtin:micro-llama", "--deployment-type",
                    "multi_node", "--launcher", "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                    "10.0.0.1", "--master-port", "29500", "--num-gpus", "1", "--output-dir", str(tmp_path))  # fmt: skip
    assert_ok(proc)
    cmd = launch_line(proc.stdout, 1)
    assert cmd[1:15] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", "1",
                         "--master_addr", "10.0.0.1", "--master_port", "29500", "--max_restarts", "0"]  # fmt: skip
    assert cmd[15] == str(ROOT / "training/step1_supervised_finetuning/main.py")


def test_rank_watch_names_the_rank_that_ended_first(train):
    """The launcher's spawn lines map pids to ranks; the first process to end is the failed rank."""
    import sys
    import threading
    import time

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dies = subprocess.Popen([sys.executable, "-c", "raise SystemExit(13)"])
    try:
        watch = RankWatch()
        for rank, p in ((0, alive), (1, dies)):
            watch.feed(f"[INFO] [launch.py:256:main] process {p.pid} spawned with command: ['python', '-u', "
                       f"'main.py', '--local_rank={rank}', '--output_dir', 'x']\n".encode())  # fmt: skip
        deadline = time.monotonic() + 30
        while watch.first is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (
            watch.report()
            == f"rank 1 (pid {dies.pid}, exit code 13) ended first; the launcher then stopped the other ranks"
        )
    finally:
        alive.kill()
        alive.wait()
        dies.wait()
    # Other nodes' spawn lines (here through pdsh) carry their machines' pids: none of them is polled here,
    # where pid 999999999 does not exist and would have been reported as a rank that ended first.
    before = set(threading.enumerate())  # the local watch's thread may still be ending: compare sets
    remote = RankWatch(local=False)
    assert not set(threading.enumerate()) - before  # nothing to poll, so no polling thread
    remote.feed(b"node-b: [INFO] [launch.py:256:main] process 999999999 spawned with command: ['python', '-u', "
                b"'main.py', '--local_rank=1']\n")  # fmt: skip
    time.sleep(0.2)
    assert remote.report() == ""
    torchrun = RankWatch()
    torchrun.feed(b"Failures:\n  <NO_OTHER_FAILURES>\n------\nRoot Cause (first observed failure):\n[0]:\n"
                  b"  time      : 2026-01-01_00:00:00\n  host      : node-b\n  rank      : 3 (local_rank: 1)\n"
                  b"  exitcode  : 13 (pid: 4242)\n")  # fmt: skip
    assert torchrun.report() == "torchrun on this node reports rank 3 failed first (exit code 13)"


# ---------------------------------------------------------------------------------------------- cluster files
def train_flags(command: str, env: dict[str, str]) -> list[str]:
    """The train.py flags of a shell command line, with the given variables substituted."""
    for k, v in env.items():
        command = command.replace(f'"${k}"', v).replace(f"${k}", v)
    words = shlex.split(command)
    return words[words.index(next(w for w in words if w.endswith("train.py"))) + 1 :]


def test_slurm_script_runs_train_py_once_per_node(train):
    path = ROOT / "configs" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M) and "#SBATCH --ntasks-per-node=1" in text
    body = text[text.index("srun ") :]
    command = body[body.index("'") + 1 : body.rindex("'")].replace("\\\n", " ")
    flags = train_flags(command, {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MASTER_ADDR": "node-a",
                                  "MASTER_PORT": "29500", "GPUS_PER_NODE": "8", "OUTPUT_DIR": "/shared/out",
                                  "@": ""})  # fmt: skip
    args, extra = train.parse_args(flags)
    assert (args.deployment_type, args.launcher, args.nnodes, args.node_rank) == (
        "multi_node",
        "torchrun",
        2,
        1,
    )
    assert (
        args.master_addr == "node-a" and args.num_gpus == 8 and args.output_dir == "/shared/out" and not extra
    )
    assert "--kill-on-bad-exit=1" in text
    # Slurm 22.05 to 23.02 do not hand sbatch's --cpus-per-task to srun: 8 ranks on one core
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in text


def test_kubernetes_job_runs_train_py_once_per_node_on_a_shared_volume(train):
    docs = list(yaml.safe_load_all((ROOT / "configs" / "k8s" / "train-job.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    job, svc = kinds["Job"], kinds["Service"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    container = pod["containers"][0]
    flags = train_flags(container["args"][0], {"JOB_COMPLETION_INDEX": "1"})
    args, _ = train.parse_args(flags)
    assert args.launcher == "torchrun" and args.nnodes == spec["completions"] and args.node_rank == 1
    assert args.master_addr == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert str(args.master_port) in {str(p["port"]) for p in svc["spec"]["ports"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[args.output_dir])
    claim = kinds["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert Path(container["workingDir"]).name == "dschat"


def test_a_step_that_exits_0_without_its_summary_fails_the_job(train, tmp_path, monkeypatch, capsys):
    # MPICH's rank helper exits 0 whatever its rank did; step 2 must not start on a missing step 1
    ran = []
    monkeypatch.setattr(train, "run_step", lambda cmd, log, **kw: ran.append(cmd) or (0, ""))
    code = train.main(
        ["--step", "1", "2", "--actor-model", "builtin:micro-llama", "--output-dir", str(tmp_path)]
    )
    assert code == 1 and len(ran) == 1
    err = capsys.readouterr().err
    assert (
        "step 1 (" in err
        and "exited 0 but wrote no" in err
        and str(tmp_path / "step1" / "summary.json") in err
    )


def steps_that_finish(train, monkeypatch) -> list[tuple[list[str], dict]]:
    """Replace train.py's step runner by one that starts nothing and writes the step's summary (a finished
    step); returns the ``(command, environment)`` of each step it was asked to run."""
    ran = []

    def run_step(cmd, log, **kw):
        ran.append((cmd, kw["env"]))
        log.parent.mkdir(parents=True, exist_ok=True)
        (log.parent / "summary.json").write_text("{}")
        return 0, ""

    monkeypatch.setattr(train, "run_step", run_step)
    return ran


def test_each_step_gets_a_port_found_free_when_it_starts(train, tmp_path, monkeypatch):
    # One port found before step 1 may be taken by the time step 3 starts, hours later.
    import dschat.utils.dist

    ports = iter(range(41000, 41010))
    monkeypatch.setattr(dschat.utils.dist, "free_port", lambda: next(ports))
    ran = steps_that_finish(train, monkeypatch)
    code = train.main(["--step", "1", "2", "--actor-model", "builtin:micro-llama", "--deployment-type", "single_node",
                       "--num-gpus", "1", "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 0 and len(ran) == 2
    used = [cmd[cmd.index("--master_port") + 1] for cmd, _ in ran]
    assert used[0] != used[1] and {int(p) for p in used} <= set(range(41000, 41010))


def test_torchrun_cpu_ranks_are_started_with_their_share_of_the_cores(train, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("dschat.launch.launcher.cpu_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ran = steps_that_finish(train, monkeypatch)
    code = train.main(["--step", "1", "--actor-model", "builtin:micro-llama", "--deployment-type", "multi_node",
                       "--launcher", "torchrun", "--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                       "--master-port", "29500", "--num-gpus", "2", "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 0 and ran[0][1].get("OMP_NUM_THREADS") == "4"


def test_step_3s_rules_across_its_options_stop_a_job_before_step_1(tmp_path):
    """A preset's step 3 that breaks a rule spanning its option groups is refused before step 1 starts,
    not after steps 1 and 2 have trained."""
    preset = tmp_path / "p.yaml"
    preset.write_text("model: builtin:micro-llama\nstep3:\n  --share_reference_with_actor: true\n")
    proc = train_py("--preset", str(preset), "--dry-run", "--output-dir", str(tmp_path / "out"))
    error_line(proc, "--share_reference_with_actor needs --actor_lora_dim")
    assert "==> step 1" not in proc.stdout and not (tmp_path / "out").exists()


def test_step_3_without_a_critic_or_reward_model_does_not_need_step_2(tmp_path):
    """A verifier as the whole reward with a critic-free estimator reads nothing from step 2: step 3
    alone after step 1 is not refused for want of it; with a reward model it is."""
    out = tmp_path / "out"
    (out / "step1").mkdir(parents=True)
    (out / "step1" / "summary.json").write_text("{}")
    rlvr = ["--reward_fn", "dschat.tasks:verifier_reward", "--reward_fn_mode", "replace", "--advantage_estimator",
            "rloo", "--n_samples_per_prompt", "4"]  # fmt: skip
    common = ["--preset", "none", "--step", "3", "--dry-run", "--output-dir", str(out)]
    assert_ok(train_py(*common, "--", *rlvr))
    error_line(train_py(*common), "--step 3 needs a finished step 2")


def test_a_critic_free_estimator_over_a_preset_with_a_critic(tmp_path):
    """builtin-tiny's step 3 trains a critic (--critic_learning_rate, --freezing_actor_steps): a user's
    `-- --advantage_estimator rloo` was refused for the preset's --freezing_actor_steps. The preset's critic
    flags are left out, saying so; the user's own critic flag is refused, naming it."""
    out = tmp_path / "out"
    for step in ("step1", "step2"):
        (out / step).mkdir(parents=True)
        (out / step / "summary.json").write_text("{}")
    common = ["--preset", "builtin-tiny", "--step", "3", "--dry-run", "--output-dir", str(out), "--",
              "--advantage_estimator", "rloo", "--n_samples_per_prompt", "4"]  # fmt: skip
    proc = train_py(*common)
    assert_ok(proc)
    assert "the preset's --critic_learning_rate 0.0001 --freezing_actor_steps 10 left out" in proc.stdout
    launch = next(line for line in proc.stdout.splitlines() if line.startswith("==> step 3 ("))
    assert "--critic_learning_rate" not in launch and "--freezing_actor_steps" not in launch
    error_line(train_py(*common, "--lam", "0.9"), "--lam is the critic's, and --advantage_estimator rloo")


def test_a_plan_with_checkpointing_for_a_critic_free_step_3_sets_the_actors_only(tmp_path):
    """The main job's step 3 (RLOO) planned for a 4 GiB GPU picks checkpointing; the plan added the critic's
    switch too, which a critic-free step 3 refuses: the planned step would not have started."""
    out = tmp_path / "out"
    for step in ("step1", "step2"):
        (out / step).mkdir(parents=True)
        (out / step / "summary.json").write_text("{}")
    proc = train_py("--step", "3", "--dry-run", "--output-dir", str(out), "--device-memory", "4")
    assert_ok(proc)
    launch = next(line for line in proc.stdout.splitlines() if line.startswith("==> step 3 ("))
    assert "--actor_gradient_checkpointing" in launch and "--critic_gradient_checkpointing" not in launch
