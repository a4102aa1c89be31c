"""Pieces every training step shares around its own loop: engine construction, resume state,
epoch/micro-batch iteration, metric windows reduced over ranks, and checkpoint cadence.

Steps 1 and 2 (reward model, DPO) share one training loop, :func:`train_loop`; each step's ``main.py``
gives it what differs (:class:`LoopSpec`: the micro-batch's forward, loss, backward and step, and the
log columns), so the algorithm still reads top to bottom there. Step 3's rounds are PPO's own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from dschat.config import DeepSpeedArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs
from dschat.engine import core as engine_core
from dschat.engine import ds_config as dsc
from dschat.engine.checkpoint import (
    agreed_latest_tag,
    export_hf_model,
    latest_tag,
    load_checkpoint,
    load_checkpoint_tensors,
    save_checkpoint,
)
from dschat.models.layers import freeze_below, top_block_names
from dschat.models.loading import count_parameters
from dschat.models.lora import inject_lora
from dschat.tasks.accuracy import task_accuracy, true_accuracy_columns
from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.metrics import MetricsLogger, new_wandb_run_id

if TYPE_CHECKING:
    from dschat.step_setup import StepSetup

LOG = logging.getLogger("dschat")


@dataclass
class TrainState:
    """Where a run is; saved in every checkpoint and restored by ``--resume``."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of the current epoch consumed (per rank)
    micro_batch_samples: int = 0  # samples of one micro-batch over all ranks (0: not yet known)
    tokens: float = 0.0  # real (non-padding) tokens processed, all ranks
    positions: float = 0.0  # token positions the model ran, padding included, all ranks
    computed: float = 0.0  # real tokens the model ran (a packed pair's shared prompt once; else = tokens)
    train_seconds: float = 0.0
    global_batch_size: int = 0
    train_examples: int = 0  # the training set's size: the data order and a resumed position follow it
    train_fingerprint: str = ""  # and its content (dschat.data.pipeline.rows_fingerprint; "" before 11-29)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # step-specific (e.g. the KL coefficient)

    def to_client_state(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_ds_config(optim: OptimArgs, ds: DeepSpeedArgs, dtype: str) -> dict[str, Any]:
    return dsc.train_ds_config(
        zero_stage=ds.zero_stage,
        dtype=dtype,
        micro_batch_size=optim.per_device_train_batch_size,
        gradient_accumulation_steps=optim.gradient_accumulation_steps,
        world_size=dist.world_size(),
        offload=ds.offload,
        max_grad_norm=optim.max_grad_norm,
        node_local_storage=dist.node_local_storage(),  # set by the step's setup from --node_local_storage
    )


def set_trainable(
    model: torch.nn.Module,
    lora: LoraArgs,
    prefix: str = "",
    keep_trainable: tuple[str, ...] = (),
    trainable_layers: int = 0,
):
    """What trains: peft LoRA per ``lora`` (none when ``lora_dim`` is 0) and, with ``trainable_layers``
    K > 0, only the top K decoder blocks (LoRA goes into those alone; the embeddings and the blocks below
    are frozen, see :func:`dschat.models.layers.freeze_below`). ``keep_trainable`` names parameters
    (substrings) that stay trainable under ``--only_optimize_lora``, e.g. a new value head."""
    within = top_block_names(model, trainable_layers) if trainable_layers else None
    if lora.lora_dim:
        model = inject_lora(
            model,
            dim=lora.lora_dim,
            alpha=lora.lora_alpha,
            dropout=lora.lora_dropout,
            module_name=lora.lora_module_name,
            only_optimize_lora=lora.only_optimize_lora,
            flag_prefix=prefix,
            within=within,
        )
        for name, p in model.named_parameters():
            if any(k in name for k in keep_trainable):
                p.requires_grad_(True)
    if trainable_layers:
        counts = freeze_below(model, trainable_layers, flag=f"--{prefix}trainable_layers")
        LOG.info("training the top %d of %d layers: %.2fM of %.2fM parameters", trainable_layers, counts["layers"],
                 counts["trainable"] / 1e6, counts["total"] / 1e6)  # fmt: skip
    return model


def build_engine(
    model: torch.nn.Module,
    *,
    optim: OptimArgs,
    ds: DeepSpeedArgs,
    lora: LoraArgs,
    ds_config: dict[str, Any],
    total_steps: int,
    gradient_checkpointing: bool = False,
):
    """AdamW (decay/no-decay and LoRA groups) + schedule + ``deepspeed.initialize``."""
    if gradient_checkpointing:
        target = model.hf_model if hasattr(model, "hf_model") else model
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora.only_optimize_lora and hasattr(target, "enable_input_require_grads"):
            target.enable_input_require_grads()
    groups = engine_core.param_groups(model, optim.weight_decay, lora.lora_learning_rate, optim.learning_rate)
    optimizer = engine_core.make_optimizer(
        groups, lr=optim.learning_rate, betas=(optim.adam_beta1, optim.adam_beta2), offload=ds.offload
    )
    scheduler = engine_core.make_scheduler(
        optimizer, optim.lr_scheduler_type, optim.num_warmup_steps, total_steps
    )
    return engine_core.initialize_engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, ds_config=ds_config
    )


def build_frozen_engine(
    model: torch.nn.Module, *, zero_stage: int, offload: bool, dtype: str, micro_batch: int
):
    """A DeepSpeed engine without optimizer (a reference or reward model): eval mode, no gradients.
    Load ``model`` under ``zero3_loading(frozen_ds_config(...))`` first when ``zero_stage`` is 3."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = frozen_ds_config(zero_stage=zero_stage, offload=offload, dtype=dtype, micro_batch=micro_batch)
    return engine_core.initialize_engine(model, ds_config=cfg)


def frozen_ds_config(*, zero_stage: int, offload: bool, dtype: str, micro_batch: int) -> dict[str, Any]:
    return dsc.eval_ds_config(zero_stage=zero_stage, dtype=dtype, micro_batch_size=micro_batch,
                              world_size=dist.world_size(), offload=offload)  # fmt: skip


def build_step_engine(load: Callable[..., torch.nn.Module], *, model_args: ModelArgs, lora: LoraArgs,
                      optim: OptimArgs, ds: DeepSpeedArgs, dtype: str, total_steps: int,
                      keep_trainable: tuple[str, ...] = (), wrap: Callable | None = None) -> tuple[Any, int]:  # fmt: skip
    """The trained model of steps 1 and 2 as an engine: ``load(dropout=...)`` under ZeRO-3 partitioned
    loading, what trains set (:func:`set_trainable`), ``wrap`` applied (a reward model's scalar head),
    then :func:`build_engine`. Returns ``(engine, parameters)``."""
    ds_config = train_ds_config(optim, ds, dtype)
    with engine_core.zero3_loading(ds_config):
        model = load(dropout=model_args.dropout)
    model = set_trainable(
        model, lora, keep_trainable=keep_trainable, trainable_layers=model_args.trainable_layers
    )
    model = wrap(model) if wrap is not None else model
    parameters = count_parameters(model)
    engine = build_engine(model, optim=optim, ds=ds, lora=lora, ds_config=ds_config, total_steps=total_steps,
                          gradient_checkpointing=model_args.gradient_checkpointing)  # fmt: skip
    return engine, parameters


def true_accuracy(
    engine, setup: StepSetup, prompts: list[str], run: RunArgs, zero3: bool, timer
) -> dict | None:
    """The verifier's true accuracy of greedy answers to the first ``--eval_generation_samples`` held-out
    prompts (None when that is 0 or no built-in task knows them); the time goes to ``generation_eval``."""
    if not run.eval_generation_samples:
        return None
    with timer("generation_eval"):
        return task_accuracy(engine.module, setup.tokenizer, prompts[: run.eval_generation_samples],
                             device=engine.device, synced_gpus=zero3, fmt=setup.fmt)  # fmt: skip


def changed_set(saved: dict[str, Any], examples: int, fingerprint: str) -> str | None:
    """How a checkpoint's training set (the ``train_examples`` and ``train_fingerprint`` of its saved
    :class:`TrainState`) differs from this run's: ``"count"``, ``"content"`` (as many, other rows) or None.
    A side that recorded nothing (a checkpoint from before the fingerprint) is not compared."""
    if examples and saved.get("train_examples") and saved["train_examples"] != examples:
        return "count"
    if fingerprint and saved.get("train_fingerprint") and saved["train_fingerprint"] != fingerprint:
        return "content"
    return None


def resume_state(
    engine, run: RunArgs, global_batch_size: int, examples: int = 0, fingerprint: str = ""
) -> TrainState:
    """Fresh state, or the one saved with the latest checkpoint when ``--resume`` is given. ``engine`` may
    be a dict name -> engine (step 3 saves actor and critic together). ``examples`` and ``fingerprint``:
    the training set's size (step 3: its prompts) and content (:func:`training_set`), which a resume must
    share with the checkpoint."""
    state = TrainState(
        global_batch_size=global_batch_size, train_examples=examples, train_fingerprint=fingerprint
    )
    if not run.resume:
        return state
    root = Path(run.output_dir) / "checkpoints"
    tag = agreed_latest_tag(root)
    if tag is None:
        raise UserError(f"--resume: {root}/latest names no complete checkpoint")
    saved = load_checkpoint(engine, root, tag)
    if saved.get("global_batch_size") != global_batch_size:
        raise UserError(
            f"--resume: checkpoint {tag} was trained with global batch {saved.get('global_batch_size')}, this run has "
            f"{global_batch_size} (the data order and the schedule follow the global batch: keep per-device batch x "
            "accumulation x ranks)"
        )
    changed = changed_set(saved, examples, fingerprint)
    if changed == "count":
        raise UserError(
            f"--resume: checkpoint {tag} was trained on {saved['train_examples']} training examples, this run has "
            f"{examples} (the data, or what its length limits drop, changed; the data order and the position "
            "follow the set): resume on the same data, or start over with --overwrite"
        )
    if changed == "content":
        raise UserError(
            f"--resume: checkpoint {tag} was trained on other training examples than this run's (as many, "
            "but other ones: an edited data file, a data source that now gives other rows, or on-policy pairs "
            "(--policy_negatives_from) that another number of ranks sampled anew); the position would land in "
            "another set: resume on the same data and ranks, or start over with --overwrite"
        )
    fields = {f.name for f in dataclasses.fields(TrainState)}
    state = TrainState(**{k: v for k, v in saved.items() if k in fields})
    state.train_examples = examples or state.train_examples
    state.train_fingerprint = fingerprint or state.train_fingerprint
    LOG.info("resumed from %s/%s at step %d", root, tag, state.step)
    return state


def resumed_tensors(run: RunArgs, name: str) -> dict[str, torch.Tensor] | None:
    """On ``--resume``, the tensors the latest checkpoint kept under ``name`` (:func:`maybe_checkpoint`'s
    ``tensors``); None on a fresh run, or where the checkpoint has none."""
    root = Path(run.output_dir) / "checkpoints"
    tag = latest_tag(root) if run.resume else None
    return load_checkpoint_tensors(root, tag, name) if tag is not None else None


def micro_batches(loader, state: TrainState, num_epochs: int) -> Iterator[Any]:
    """Micro-batches from ``state.epoch`` / ``state.batch_in_epoch`` on, advancing ``state`` as it goes.

    A run resumed with another split of the same global batch (a smaller micro-batch and more accumulation
    after running out of memory) goes on from the same sample: the saved position counts
    the saved run's micro-batches, and checkpoints fall on optimizer steps, whole global batches."""
    per = loader.sampler.world * loader.sampler.batch_size
    if state.micro_batch_samples and state.micro_batch_samples != per:
        state.batch_in_epoch = state.batch_in_epoch * state.micro_batch_samples // per
    state.micro_batch_samples = per
    # test hook: rank DSCHAT_TEST_KILL_RANK dies (no clean-up, like a crash or an OOM kill) once
    # DSCHAT_TEST_KILL_AT_STEP optimizer steps are done; the launcher must then end the whole job
    kill_rank = os.environ.get("DSCHAT_TEST_KILL_RANK")
    kill_at = int(os.environ.get("DSCHAT_TEST_KILL_AT_STEP", "0"))
    while state.epoch < num_epochs:
        loader.sampler.set_epoch(state.epoch, state.batch_in_epoch)
        for batch in loader:
            if kill_rank is not None and state.step >= kill_at and dist.rank() == int(kill_rank):
                os._exit(13)
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def checkpoint_due(run: RunArgs, step: int, total_steps: int, since: int | None = None) -> bool:
    """Whether a multiple of ``--save_steps`` lies in (``since``, ``step``], not at the very end (the final
    model is exported). ``since``: the last step at which the caller could have saved (default ``step - 1``:
    every step can). A loop that can save only at some steps (step 3 with ``--generation_batches G``, only
    once its buffer is trained on: every G-th round) saves at the first of them at or after each due step,
    instead of only where the two coincide."""
    since = step - 1 if since is None else since
    return bool(run.save_steps) and step // run.save_steps > since // run.save_steps and step < total_steps


def maybe_checkpoint(engine, run: RunArgs, state: TrainState, total_steps: int,
                     tensors: dict[str, dict[str, torch.Tensor] | None] | None = None,
                     since: int | None = None) -> None:  # fmt: skip
    """Save every ``--save_steps`` steps (see :func:`checkpoint_due`; not at the very end: the final model is
    exported); ``tensors``: state outside the engines (see :func:`save_checkpoint`)."""
    if not checkpoint_due(run, state.step, total_steps, since):
        return
    root = Path(run.output_dir) / "checkpoints"
    save_checkpoint(
        engine, root, state.step, state.to_client_state(), keep=run.keep_checkpoints, tensors=tensors
    )
    crash_after = int(
        os.environ.get("DSCHAT_TEST_EXIT_AFTER_SAVE", "0")
    )  # test hook: a kill right after a save
    if crash_after and state.step >= crash_after:
        os._exit(17)


class MetricWindow:
    """Sums of per-micro-batch quantities since the last log line, reduced over ranks on demand."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)

    def add(self, **values: float | torch.Tensor) -> None:
        for k, v in values.items():
            self._sums[k] += float(v.detach()) if isinstance(v, torch.Tensor) else float(v)

    def reduce(self) -> dict[str, float]:
        """Sums over all ranks (a collective: call on every rank), then reset."""
        totals = self.peek(*sorted(self._sums))
        self._sums.clear()
        return totals

    def peek(self, *keys: str) -> dict[str, float]:
        """The sums of ``keys`` over all ranks, kept (a collective: call on every rank)."""
        return dict(zip(keys, dist.all_reduce_sum([self._sums.get(k, 0.0) for k in keys])))


@dataclass(frozen=True)
class LoopSpec:
    """What one step's training loop does that the others do not (see :func:`train_loop`)."""

    desc: str  # the progress bar's label
    # micro-batch -> sums for the metric window, after forward, backward and ``engine.step()``; they hold
    # ``loss`` and the batch's real ``tokens`` and ``positions`` (padding included)
    micro_step: Callable[[dict[str, Any]], dict[str, float | torch.Tensor]]
    # (window sums over all ranks, seconds per rank) -> the step's own log columns (accuracy, margin ...)
    columns: Callable[[dict[str, float], float], dict[str, float]]
    shown: tuple[tuple[str, str, str], ...]  # (label, column, format) on the progress bar and the log line
    # For a loss that is a mean over tokens (SFT): micro-batch -> its count of them. The loop then counts
    # them over the whole optimizer step (every micro-batch, every rank) first and passes ``micro_step``
    # that count over ranks x accumulation as ``token_share``: DeepSpeed divides each micro-batch's loss
    # by the accumulation and averages the ranks' gradients, so a micro-batch that divides its token sum
    # by ``token_share`` makes the step's gradient that of the mean over the step's tokens, whatever the
    # split into micro-batches and ranks (a mean per micro-batch weighs a token by how few others share
    # its micro-batch). The micro-step then returns ``loss`` as the sum over its tokens and
    # ``loss_weight`` as their number, so the logged loss is the same token mean.
    targets: Callable[[dict[str, Any]], int] | None = None


def optimizer_steps(batches: Iterator[Any], state: TrainState, accumulation: int) -> Iterator[list[Any]]:
    """The micro-batches of ``batches`` (:func:`micro_batches`, which advances ``state``) grouped by optimizer
    step: ``accumulation`` of them, the last ending where ``state.batch_in_epoch`` reaches a multiple of it
    (every epoch ends on one: the sampler cuts it to whole global batches)."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if state.batch_in_epoch % accumulation == 0:
            yield group
            group = []


def clock() -> float:
    """Seconds, after the GPU's queued work (throughput counts finished work)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def train_loop(engine, loader, state: TrainState, spec: LoopSpec, *, optim: OptimArgs, run: RunArgs,
               total_steps: int, metrics: MetricsLogger, timer, evaluate: Callable[[int], Any]) -> int:  # fmt: skip
    """The loop steps 1 and 2 share: micro-batches from where ``state`` stands, an optimizer step every
    ``--gradient_accumulation_steps`` of them (DeepSpeed scales and steps at the boundary), a log row every
    ``--log_interval`` steps (``loss`` averaged over micro-batches and ranks, or over tokens with
    :attr:`LoopSpec.targets`, the step's columns, ``lr``,
    real ``tokens_per_sec``, ``epoch``, ``tokens``), evaluation every ``--eval_interval`` steps and a
    checkpoint every ``--save_steps``, until ``total_steps``. Returns the optimizer steps DeepSpeed skipped
    (:class:`dschat.engine.core.SkippedSteps`, which stops a run that skips step after step)."""
    world = dist.world_size()
    window = MetricWindow()
    bar = tqdm(total=total_steps, initial=state.step, disable=not dist.is_main(), desc=spec.desc,
               dynamic_ncols=True, mininterval=1.0 if sys.stdout.isatty() else 30.0)  # fmt: skip
    engine.train()
    skipped = engine_core.SkippedSteps(engine, "model")
    for group in optimizer_steps(micro_batches(loader, state, optim.num_train_epochs), state,
                                 optim.gradient_accumulation_steps):  # fmt: skip
        t0 = clock()
        skipped.mark()
        lr = engine.get_lr()[0]  # the rate this step uses (after it, the scheduler has moved on)
        kw = {}
        if spec.targets is not None:  # the step's token count on every rank (one all-reduce per step)
            count = dist.all_reduce_sum([float(sum(spec.targets(b) for b in group))])[0]
            kw["token_share"] = max(count, 1.0) / (world * optim.gradient_accumulation_steps)
        for batch in group:
            sums = spec.micro_step(batch, **kw)
            window.add(micro=1, seconds=clock() - t0, **sums)
            t0 = clock()
        state.step += 1
        skipped.check()
        bar.update(1)
        if should_log(state.step, run.log_interval, total_steps):
            w = window.reduce()
            seconds = max(w["seconds"] / world, 1e-9)
            take_in(state, w, world)
            row = {"loss": w["loss"] / w.get("loss_weight", w["micro"]), **spec.columns(w, seconds), "lr": lr,
                   "tokens_per_sec": w["tokens"] / seconds, "epoch": state.epoch, "tokens": state.tokens}  # fmt: skip
            metrics.log(row, step=state.step, split="train")
            bar.set_postfix({label: format(row[key], f) for label, key, f in spec.shown})
            if not sys.stdout.isatty():
                LOG.info("step %d/%d %s", state.step, total_steps,
                         " ".join(f"{label} {format(row[key], f)}" for label, key, f in spec.shown))  # fmt: skip
        if run.eval_interval and state.step % run.eval_interval == 0 and state.step < total_steps:
            evaluate(state.step)
        with timer("checkpoint"):  # atomic; a resume continues at exactly the next micro-batch
            maybe_checkpoint(engine, run, with_unlogged(state, window, world) if checkpoint_due(run, state.step, total_steps)
                             else state, total_steps)  # fmt: skip
        if state.step >= total_steps:
            break
    bar.close()
    return skipped.count


def take_in(state: TrainState, window_sums: dict[str, float], world: int) -> None:
    """Add a metric window's real tokens, positions, computed tokens and seconds (summed over ``world``
    ranks) to ``state``; a step whose micro-step returns no ``computed`` ran its real tokens."""
    state.tokens += window_sums["tokens"]
    state.positions += window_sums["positions"]
    state.computed += window_sums.get("computed", window_sums["tokens"])
    state.train_seconds += window_sums["seconds"] / world


def with_unlogged(state: TrainState, window: MetricWindow, world: int) -> TrainState:
    """The state to save at a step between log rows: with the tokens and seconds since the last row,
    which the state takes in only at the next row and a resumed run would lose (a collective)."""
    saved = dataclasses.replace(state)
    take_in(saved, window.peek("tokens", "positions", "computed", "seconds"), world)
    return saved


def export_model(model: torch.nn.Module, tokenizer, out_dir: str | Path, timer) -> None:
    """The trained model in Hugging Face format (safetensors); the time goes to ``export``."""
    with timer("export"):
        export_hf_model(model, tokenizer, out_dir)


def run_summary(state: TrainState, timer, *, parameters: int, dtype: str, zero_stage: int, lora_dim: int,
                run: RunArgs, start_step: int, skipped_steps: int) -> dict[str, Any]:  # fmt: skip
    """The summary.json entries every step of :func:`train_loop` writes: throughput in real tokens,
    padding, time and how the run was set up."""
    return {
        "train_tokens_per_sec": state.tokens / max(state.train_seconds, 1e-9),
        # the share of the positions the model ran that held padding (packed pairs run fewer real tokens
        # than the pairs hold: against those, the padding looked smaller than it was)
        "padding_fraction": 1 - (state.computed or state.tokens) / max(state.positions, 1.0),
        "train_seconds": state.train_seconds,
        "wall_seconds": timer.wall(),
        "seconds_by_phase": timer.totals,
        "parameters": parameters,
        "dtype": dtype,
        "world_size": dist.world_size(),
        "zero_stage": zero_stage,
        "lora_dim": lora_dim,
        "resumed_from_step": start_step if run.resume else None,
        # optimizer steps DeepSpeed skipped (inf/NaN gradients; in fp16 also the loss scale's search)
        "skipped_steps": skipped_steps,
    }


def accuracy_summary(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, float]:
    """``true_accuracy_start`` / ``_end`` and ``true_accuracy/<task>_start`` / ``_end`` (step 3's names, those
    of the metrics) from two task-accuracy results (``accuracy`` and ``accuracy/<task>`` keys); empty unless
    both were measured."""
    if not (start and end):
        return {}
    return {f"{k}_{when}": v for when, r in (("start", start), ("end", end))
            for k, v in true_accuracy_columns(r).items()}  # fmt: skip


def should_log(step: int, interval: int, total: int) -> bool:
    return step == total or (interval > 0 and step % interval == 0)


def open_metrics(run: RunArgs, resolved: dict[str, Any], state: TrainState) -> MetricsLogger:
    """metrics.jsonl (on --resume: its rows up to the checkpoint's step kept, the run's appended), plus
    TensorBoard and W&B when asked for (a resumed run logs to the W&B run it started)."""
    wandb_id = start_of_run(state, "wandb_run_id", new_wandb_run_id) if run.enable_wandb else None
    return MetricsLogger(
        run.output_dir, config=resolved, enable_tensorboard=run.enable_tensorboard,
        tensorboard_path=run.tensorboard_path, enable_wandb=run.enable_wandb, wandb_project=run.wandb_project,
        run_name=Path(run.output_dir).name, wandb_run_id=wandb_id, append=run.resume, keep_through=state.step,
    )  # fmt: skip


def start_of_run(state: TrainState, key: str, measure: Callable[[], Any]) -> Any:
    """A measurement of where the run started (the evaluation before its first step, its first log row):
    taken once and kept in ``state.extra``, which every checkpoint saves, so that a resumed run reports
    the start of the run in its summary (``*_start``), not the step it resumed from, and does not log
    that evaluation again."""
    if key not in state.extra:
        state.extra[key] = measure()
    return state.extra[key]


def training_set(loader) -> tuple[int, str]:
    """A training loader's set: its size and content fingerprint, which a resume must share."""
    from dschat.data.pipeline import rows_fingerprint

    return loader.sampler.n, rows_fingerprint(loader.dataset)


def open_run(
    engine, run: RunArgs, global_batch_size: int, resolved: dict[str, Any], loader
) -> tuple[TrainState, int, MetricsLogger]:
    """The run's state (:func:`resume_state` on ``loader``'s set), the step it starts from and its
    metrics loggers."""
    state = resume_state(engine, run, global_batch_size, *training_set(loader))
    return state, state.step, open_metrics(run, resolved, state)
