"""dschat.utils.run: output directory rules and the files that mark a run."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from dschat.utils import run
from dschat.utils.errors import UserError
from dschat.utils.run import check_output_dir, clear_previous_run


def finished(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text("{}")
    return path


def with_checkpoint(path):
    (path / "checkpoints" / "latest").mkdir(parents=True)
    return path


@pytest.mark.parametrize(("overwrite", "resume"), [(False, False), (True, False)])
def test_new_or_empty_directory_is_fine(tmp_path, overwrite, resume):
    check_output_dir(str(tmp_path / "new"), overwrite=overwrite, resume=resume)
    assert not (tmp_path / "new").exists()
    check_output_dir(str(tmp_path), overwrite=overwrite, resume=resume)


def test_directory_with_unrelated_files_is_fine(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "checkpoints").mkdir()  # no 'latest': nothing to resume
    check_output_dir(str(tmp_path), overwrite=False, resume=False)


def test_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match=re.escape(f"--output_dir {f}: exists and is not a directory")):
        check_output_dir(str(f), overwrite=True, resume=False)


def test_finished_run_needs_overwrite(tmp_path):
    out = finished(tmp_path / "out")
    with pytest.raises(
        UserError,
        match=re.escape(f"--output_dir {out}: holds a finished run (summary.json); pass --overwrite"),
    ):
        check_output_dir(str(out), overwrite=False, resume=False)
    with pytest.raises(UserError, match="holds a finished run"):
        check_output_dir(str(out), overwrite=False, resume=True)
    check_output_dir(str(out), overwrite=True, resume=False)


def test_unfinished_run_needs_resume_or_overwrite(tmp_path):
    out = with_checkpoint(tmp_path / "out")
    with pytest.raises(
        UserError, match=re.escape("pass --resume to continue it or --overwrite to start over")
    ):
        check_output_dir(str(out), overwrite=False, resume=False)
    check_output_dir(str(out), overwrite=False, resume=True)
    check_output_dir(str(out), overwrite=True, resume=False)


def test_resume_without_checkpoint(tmp_path):
    with pytest.raises(
        UserError, match=re.escape(f"--resume: no checkpoint to resume from in {tmp_path / 'checkpoints'}")
    ):
        check_output_dir(str(tmp_path), overwrite=False, resume=True)
    with pytest.raises(UserError, match="--resume: no checkpoint"):
        check_output_dir(str(tmp_path / "missing"), overwrite=False, resume=True)


def test_flag_name_is_used(tmp_path):
    out = finished(tmp_path / "actor")
    with pytest.raises(UserError, match=re.escape(f"--actor_output_dir {out}: holds a finished run")):
        check_output_dir(str(out), overwrite=False, resume=False, flag="--actor_output_dir")


def test_finished_with_checkpoints_and_overwrite(tmp_path):
    out = with_checkpoint(finished(tmp_path / "out"))
    check_output_dir(str(out), overwrite=True, resume=False)


def test_an_output_directory_under_a_file_is_one_line(tmp_path):
    """--output-dir afile, afile a file: each step's directory (afile/step1) does not exist, so it passed,
    and the run died in start-up with NotADirectoryError's traceback."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(
        UserError, match=r"^--output_dir .*afile/step1: .*afile exists and is not a directory$"
    ):
        check_output_dir(str(tmp_path / "afile" / "step1"), overwrite=False, resume=False)
    check_output_dir(str(tmp_path / "new" / "step1"), overwrite=False, resume=False)  # a directory to make


def test_clear_previous_run(tmp_path):
    out = with_checkpoint(finished(tmp_path / "out"))
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "model.safetensors").write_text("keep")
    clear_previous_run(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    check_output_dir(str(out), overwrite=False, resume=False)


def test_overwrite_clears_step_3s_models_and_the_dashboards_logs(tmp_path):
    """--overwrite: a new step 3 without an EMA or a critic left the old actor_ema/ or critic/ beside its
    own config (which then described it), and TensorBoard showed the old run's points beside the new."""
    from dschat.utils.run import STEP3_MODEL_DIRS

    out = finished(tmp_path / "out")
    for d in ("actor", "critic", "actor_ema", "tensorboard", "wandb"):
        (out / d).mkdir()
        (out / d / "x").write_text("old")
    clear_previous_run(str(out), STEP3_MODEL_DIRS)
    # W&B's local folder is an offline run's only copy, and W&B does not draw from it: it stays
    assert sorted(p.name for p in out.iterdir()) == ["wandb"]
    # another step names no model directories: a folder called actor there is not its to remove
    (out / "actor").mkdir()
    clear_previous_run(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["actor", "wandb"]


def test_clear_previous_run_only_on_rank_0(tmp_path, monkeypatch):
    out = finished(tmp_path / "out")
    monkeypatch.setenv("RANK", "1")
    clear_previous_run(str(out))
    assert (out / "summary.json").exists()


def test_summary_and_config_files(tmp_path):
    run.save_resolved_config(str(tmp_path), {"b": 2, "a": 1})
    status = Path("/proc/self/status").read_text().splitlines()
    rss_before = int(next(x for x in status if x.startswith("VmRSS")).split()[1]) * 1024
    run.write_summary(str(tmp_path), {"loss": 0.5})
    assert json.loads((tmp_path / "dschat_config.json").read_text()) == {"a": 1, "b": 2}
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the process's peak RSS is added (the kernel updates its high-water mark lazily, so compare loosely
    # with the resident size just before)
    assert 0.5 * rss_before <= summary.pop("peak_rss_bytes") <= 4 * rss_before
    # and the whole process's time so far (set-up included), from the first import of dschat.utils.run
    assert 0 < summary.pop("process_wall_seconds") <= time.perf_counter() - run.PROCESS_START
    # and, once this process has used a GPU, the peaks of torch's allocator there
    gpu = {k: summary.pop(k) for k in ("peak_gpu_allocated_bytes", "peak_gpu_reserved_bytes") if k in summary}
    used_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert sorted(gpu) == (["peak_gpu_allocated_bytes", "peak_gpu_reserved_bytes"] if used_gpu else [])
    assert summary == {"loss": 0.5}
    with pytest.raises(UserError, match="holds a finished run"):
        check_output_dir(str(tmp_path), overwrite=False, resume=False)


def test_summary_not_written_on_other_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    run.write_summary(str(tmp_path), {"loss": 0.5})
    assert not (tmp_path / "summary.json").exists()


def test_stopwatch_accumulates(monkeypatch):
    clock = iter([0.0, 10.0, 12.5, 20.0, 21.0, 30.0])
    monkeypatch.setattr(run.time, "perf_counter", lambda: next(clock))
    sw = run.Stopwatch()  # start at 0.0
    with sw("train"):  # 10.0 -> 12.5
        pass
    with sw("train"):  # 20.0 -> 21.0
        pass
    assert sw.totals == {"train": 3.5}
    assert sw.wall() == 30.0


def test_a_resume_must_resolve_the_same_dtype_and_zero_ranks(tmp_path):
    """--dtype auto saved as the word "auto" was all a resume compared: on a host without bf16 instructions
    it resolved fp32 (the optimizer state failed to load with a traceback, or the run went on in another
    precision); a ZeRO-partitioned run resumed on another rank count failed deep in DeepSpeed's load."""
    import json

    from dschat.utils.errors import UserError
    from dschat.utils.run import save_resolved_config

    saved = {"dtype": "auto", "resolved_dtype": "bf16", "world_size": 2, "zero_stage": 2}
    (tmp_path / "dschat_config.json").write_text(json.dumps(saved))
    with pytest.raises(
        UserError, match=r"trained in bf16, this one resolves --dtype auto to fp32: resume with --dtype bf16"
    ):
        save_resolved_config(str(tmp_path), {**saved, "resolved_dtype": "fp32"}, resume=True)
    with pytest.raises(UserError, match=r"split over 2 ranks, this run has 1"):
        save_resolved_config(str(tmp_path), {**saved, "world_size": 1}, resume=True)
    step3 = {
        "resolved_dtype": "bf16",
        "world_size": 2,
        "actor": {"zero_stage": 0},
        "critic": {"zero_stage": 3},
    }
    (tmp_path / "dschat_config.json").write_text(json.dumps(step3))
    with pytest.raises(UserError, match=r"split over 2 ranks"):
        save_resolved_config(str(tmp_path), {**step3, "world_size": 4}, resume=True)
    unsharded = {**saved, "zero_stage": 0}
    (tmp_path / "dschat_config.json").write_text(json.dumps(unsharded))
    save_resolved_config(str(tmp_path), {**unsharded, "world_size": 1}, resume=True)  # ZeRO-0: any rank count
    assert json.loads((tmp_path / "dschat_config.json").read_text())["world_size"] == 1


def test_trained_config_reads_the_step_directory_only_for_step_3_models(tmp_path, monkeypatch):
    """A model's own dschat_config.json, or for step 3's actor/, critic/, actor_ema/ the step's above it.
    Any parent was read, so a bare relative name (or builtin:NAME) run from inside a run's directory took
    that run's prompt format for an unrelated model."""
    import json

    from dschat.utils.run import trained_config

    (tmp_path / "dschat_config.json").write_text(json.dumps({"chat_template": "off"}))
    for name in ("actor", "critic", "actor_ema", "other"):
        (tmp_path / name).mkdir()
    assert trained_config(tmp_path / "actor") == {"chat_template": "off"}
    assert trained_config(tmp_path / "actor_ema") == {"chat_template": "off"}
    assert trained_config(tmp_path / "other") == {}
    monkeypatch.chdir(tmp_path)
    assert trained_config("builtin:micro-llama") == {} and trained_config("other") == {}
    assert trained_config(".") == {"chat_template": "off"}  # the run's own directory


def test_a_resumed_step_refuses_a_checkpoint_of_a_run_whose_input_was_trained_again(tmp_path):
    # the interrupted run started from step 1's output; step 1 was run again since: its checkpoint would
    # continue training from the earlier model
    from dschat.utils.run import check_resumed_environment, input_runs

    step1, out = tmp_path / "step1", tmp_path / "step3"
    step1.mkdir()
    out.mkdir()
    (step1 / "summary.json").write_text('{"run": 1}')
    (out / "dschat_config.json").write_text(json.dumps({"input_runs": input_runs(step1)}))
    check_resumed_environment(str(out), {})
    (step1 / "summary.json").write_text('{"run": 2}')
    with pytest.raises(
        UserError, match=r"--resume: .*step1 was trained again since this run started from it"
    ):
        check_resumed_environment(str(out), {})


def test_input_runs_are_recorded_by_absolute_path(tmp_path, monkeypatch):
    # train.py passes relative paths (output/step1): recorded as given, a resume from another working
    # directory found nothing there and compared nothing
    from dschat.utils.run import changed_inputs, input_runs

    (tmp_path / "output" / "step1").mkdir(parents=True)
    (tmp_path / "output" / "step1" / "summary.json").write_text('{"run": 1}')
    monkeypatch.chdir(tmp_path)
    recorded = input_runs("output/step1")
    assert list(recorded) == [str(tmp_path / "output" / "step1")]
    (tmp_path / "output" / "step1" / "summary.json").write_text('{"run": 2}')
    monkeypatch.chdir("/")
    assert changed_inputs({"input_runs": recorded}) == [str(tmp_path / "output" / "step1")]
