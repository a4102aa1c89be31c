"""dschat.config.check_resume: a resumed run keeps the options that change what it computes."""

from __future__ import annotations

import json

import pytest

from dschat import config as C
from dschat.utils.errors import UserError

STEP = (C.OptimArgs, C.RunArgs)
STEP3 = ((C.OptimizerArgs, "actor_", ("num_warmup_steps",)), C.PPOArgs, C.RunArgs)


def saved_run(tmp_path, specs, argv):
    """The dschat_config.json a run with ``argv`` saved, as the steps write it (prefixed groups nested)."""
    groups = C.parse_groups("t", "", specs, [*argv, "--output_dir", str(tmp_path)])
    cfg: dict = {}
    for spec, g in zip(specs, groups):
        prefix = "" if isinstance(spec, type) else spec[1]
        (cfg.setdefault(prefix.rstrip("_"), {}) if prefix else cfg).update(C.to_dict(g))
    (tmp_path / "dschat_config.json").write_text(json.dumps(cfg, default=str))


def check(tmp_path, specs, argv):
    groups = C.parse_groups("t", "", specs, [*argv, "--output_dir", str(tmp_path), "--resume"])
    C.check_resume(specs, groups, str(tmp_path), resume=True)


def test_memory_and_logging_levers_may_change(tmp_path):
    saved_run(tmp_path, STEP, ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"])
    check(tmp_path, STEP, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
                           "--save_steps", "5", "--log_interval", "1", "--enable_tensorboard"])  # fmt: skip


def test_every_changed_option_that_changes_the_maths_is_named_in_one_error(tmp_path):
    saved_run(tmp_path, STEP, ["--max_steps", "6", "--seed", "3"])
    with pytest.raises(UserError) as e:
        check(
            tmp_path,
            STEP,
            ["--max_steps", "12", "--seed", "4", "--learning_rate", "7e-4", "--save_steps", "1"],
        )
    msg = str(e.value)
    assert (
        "--max_steps 6 -> 12" in msg
        and "--seed 3 -> 4" in msg
        and "--learning_rate 0.001 -> 0.001" not in msg
    )
    assert "--learning_rate" in msg and "--save_steps" not in msg and "\n" not in msg
    assert str(tmp_path / "dschat_config.json") in msg and "--overwrite" in msg


def test_step3s_prefixed_groups_are_compared_with_their_section(tmp_path):
    saved_run(tmp_path, STEP3, ["--actor_learning_rate", "1e-5", "--kl_coef", "0.1"])
    check(tmp_path, STEP3, ["--actor_learning_rate", "1e-5", "--kl_coef", "0.1"])
    with pytest.raises(UserError, match=r"--actor_learning_rate 1e-05 -> 2e-05"):
        check(tmp_path, STEP3, ["--actor_learning_rate", "2e-5", "--kl_coef", "0.1"])
    with pytest.raises(UserError, match=r"--kl_coef 0.1 -> 0.2"):
        check(tmp_path, STEP3, ["--actor_learning_rate", "1e-5", "--kl_coef", "0.2"])


def test_nothing_to_compare_without_a_saved_configuration(tmp_path):
    check(tmp_path, STEP, ["--max_steps", "12"])


def _tags_on_a_rank(rank: int, roots: list[str], tags: list[str | None]) -> str:
    from pathlib import Path

    from dschat.engine.checkpoint import agreed_latest_tag

    root = Path(roots[rank])  # node-local storage: each node its own directory
    root.mkdir(parents=True, exist_ok=True)
    if tags[rank] is not None:
        (root / tags[rank]).mkdir()
        (root / "latest").write_text(tags[rank])
    try:
        return str(agreed_latest_tag(root))
    except UserError as e:
        return f"UserError: {e}"


@pytest.mark.parametrize(("tags", "agreed"), [(["step4", "step4"], "step4"), (["step2", "step4"], None),
                                               (["step4", None], None), ([None, None], "None")])  # fmt: skip
def test_every_rank_resumes_from_the_same_checkpoint(tmp_path, tags, agreed):
    """With --node_local_storage each node read its own ``latest``: a node stopped between its peers'
    saves resumed from an older checkpoint (ZeRO-0/1/2: the ranks went on with different weights), and a
    node without one refused while its peers waited in the collective load. All ranks agree or all refuse."""
    from tests.unit.gloo import on_two_ranks

    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = on_two_ranks(_tags_on_a_rank, roots, tags, timeout=60)
    if agreed is not None:
        assert out == {0: agreed, 1: agreed}
    else:
        assert out[0] == out[1] and out[0].startswith(
            "UserError: --resume: the ranks' latest checkpoints differ"
        )


def test_a_resume_on_another_training_set_is_one_line(tmp_path):
    """The data order and the resumed position follow the training set's size: a resume on a smaller set
    was a ValueError traceback from the sampler, one on another size continued in another order."""
    from dschat.engine.checkpoint import save_checkpoint
    from dschat.trainer import TrainState, resume_state

    class Engine:  # what save_checkpoint and load_checkpoint ask of an engine
        def save_checkpoint(self, root, tag, client_state, save_latest):
            (tmp_path / "out" / "checkpoints" / tag).mkdir(parents=True)
            (tmp_path / "client.json").write_text(json.dumps(client_state))

        def load_checkpoint(self, root, tag, **kw):
            return tag, json.loads((tmp_path / "client.json").read_text())

    state = TrainState(step=4, global_batch_size=8, train_examples=100)
    save_checkpoint(Engine(), tmp_path / "out" / "checkpoints", 4, state.to_client_state())
    run = C.RunArgs(output_dir=str(tmp_path / "out"), resume=True)
    assert resume_state(Engine(), run, 8, examples=100).step == 4
    with pytest.raises(
        UserError, match=r"--resume: checkpoint step4 was trained on 100 training examples, this run has 90"
    ):
        resume_state(Engine(), run, 8, examples=90)


def test_a_resume_on_as_many_other_training_examples_is_one_line(tmp_path):
    """Only the count was compared: an edited data file with as many rows resumed silently at a position
    in another set. The content fingerprint is compared too (a checkpoint from before it had none: kept)."""
    import torch

    from dschat.data.pipeline import rows_fingerprint
    from dschat.engine.checkpoint import save_checkpoint
    from dschat.trainer import TrainState, resume_state

    class Engine:
        def save_checkpoint(self, root, tag, client_state, save_latest):
            (tmp_path / "out" / "checkpoints" / tag).mkdir(parents=True, exist_ok=True)
            (tmp_path / "client.json").write_text(json.dumps(client_state))

        def load_checkpoint(self, root, tag, **kw):
            return tag, json.loads((tmp_path / "client.json").read_text())

    rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, 2, 3])} for _ in range(3)]
    edited = [*rows[:2], {"input_ids": torch.tensor([1, 2, 4]), "labels": torch.tensor([-100, 2, 4])}]
    same, other = rows_fingerprint(rows), rows_fingerprint(edited)
    assert same == rows_fingerprint([dict(r) for r in rows]) and same != other
    assert rows_fingerprint(rows[::-1]) == same and rows_fingerprint(edited[::-1]) != other  # order counts
    run = C.RunArgs(output_dir=str(tmp_path / "out"), resume=True)
    for saved in ("", same):  # a checkpoint without a fingerprint, then one with it
        state = TrainState(step=4, global_batch_size=8, train_examples=3, train_fingerprint=saved)
        save_checkpoint(Engine(), tmp_path / "out" / "checkpoints", 4, state.to_client_state())
        assert resume_state(Engine(), run, 8, 3, same).train_fingerprint == same
    with pytest.raises(
        UserError, match=r"^--resume: checkpoint step4 was trained on other training examples"
    ):
        resume_state(Engine(), run, 8, 3, other)


def test_a_resume_on_other_ptx_data_is_one_line():
    """Step 3 saved only where its PTX loader stood: another PTX set (--unsupervised_dataset_name's file
    edited) raised a sampler traceback where it was smaller and read another order where it was as large."""
    from dschat.trainer import TrainState
    from training.step3_rlhf_finetuning.main import PTX_POSITION, Rounds

    def rounds(examples: int, fingerprint: str) -> Rounds:
        position = TrainState(train_examples=examples, train_fingerprint=fingerprint)
        return Rounds(
            loader=None, total=1, actor_updates=1, critic_updates=1, unsup=iter(()), unsup_position=position
        )

    saved = TrainState()
    rounds(100, "aa").save_unsup_position(saved)
    saved.extra[PTX_POSITION].update(epoch=2, batch_in_epoch=7)
    same = rounds(100, "aa")
    same.restore_unsup_position(saved)
    assert (same.unsup_position.epoch, same.unsup_position.batch_in_epoch) == (2, 7)
    with pytest.raises(
        UserError,
        match=r"^--resume: the --unsupervised_dataset_name data .* had 100 examples, this run has 90\)",
    ):
        rounds(90, "bb").restore_unsup_position(saved)
    with pytest.raises(UserError, match=r"this run has 100, as many but other ones\)"):
        rounds(100, "bb").restore_unsup_position(saved)
    old = TrainState(extra={PTX_POSITION: {"epoch": 1, "batch_in_epoch": 3}})  # saved before the check
    rounds(90, "bb").restore_unsup_position(old)


@pytest.mark.parametrize(("step", "refused"), [(2, False), (3, False), (1, True)])
def test_step1_only_options_a_later_steps_old_run_saved_are_not_compared(tmp_path, step, refused):
    """A step-2 or step-3 run started before those steps refused --train_on_prompt saved it (read by
    nothing there); its resume, now without it (train.py gives it to step 1 alone), goes on. Step 1
    reads it: there a change is refused."""
    specs = (C.DataArgs, C.RunArgs)
    saved_run(tmp_path, specs, ["--train_on_prompt"])
    cfg = json.loads((tmp_path / "dschat_config.json").read_text())
    (tmp_path / "dschat_config.json").write_text(json.dumps({**cfg, "step": step}))
    if refused:
        with pytest.raises(UserError, match=r"--train_on_prompt true -> false"):
            check(tmp_path, specs, [])
    else:
        check(tmp_path, specs, [])
