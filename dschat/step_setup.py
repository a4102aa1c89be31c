"""What steps 1 and 2 (reward model, DPO) do before their shared loop: check the output directory, start
the process group, find the model and its tokenizer and prompt format (:func:`setup_step`); batch the
prepared data and count the optimizer steps (:func:`make_batches`); begin the outputs with the resolved
configuration (:func:`begin_step`). Every step, step 3 too, begins its outputs with :func:`begin_outputs`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dschat.config import DataArgs, ModelArgs, OptimArgs, RunArgs, to_dict
from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.engine import core as engine_core
from dschat.launch.supervise import adopt_pending_log
from dschat.lm import eval_batches, train_loader
from dschat.models.loading import load_config, load_tokenizer, resolve
from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.metrics import setup_logging
from dschat.utils.run import check_output_dir, clear_previous_run, input_runs, save_resolved_config


@dataclass
class StepSetup:
    """What steps 1 and 2 know after their common start: the process group is up, the model found."""

    log: logging.Logger
    dtype: str  # resolved: fp32 | fp16 | bf16
    world: int
    model_path: str  # a directory (built-in models and GGUF files are materialised)
    tokenizer: Any
    fmt: PromptFormat  # how dialogues become model input (--chat_template), as in inference


def setup_step(model: ModelArgs, run: RunArgs, data: DataArgs) -> StepSetup:
    """Check the output directory, start torch.distributed, resolve dtype and model, load the tokenizer
    and pick the prompt format."""
    log = setup_logging(None)
    check_output_dir(run.output_dir, overwrite=run.overwrite, resume=run.resume)
    engine_core.init_distributed()
    # which ranks write files, and the DeepSpeed config's checkpoint layout, from here on
    dist.set_node_local_storage(run.node_local_storage)
    dtype = engine_core.resolve_dtype(model.dtype)
    torch.manual_seed(run.seed)
    model_path = resolve(model.model_name_or_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code=model.trust_remote_code)
    check_context(data.max_seq_len, load_config(model_path, trust_remote_code=model.trust_remote_code), tokenizer,
                  model.model_name_or_path)  # fmt: skip
    fmt = prompt_format(tokenizer, data.chat_template)
    return StepSetup(log, dtype, dist.world_size(), model_path, tokenizer, fmt)


def check_context(max_seq_len: int, config, tokenizer, name: str) -> None:
    """--max_seq_len within what the model attends to (its position limit, or its tokenizer's if smaller):
    beyond it a learned position table is indexed past its end mid-run, and a rotary model trains on
    positions it never saw."""
    from dschat.generation.decoding import known_context_length

    limit = known_context_length(config, tokenizer)  # None: no position limit (ALiBi), nothing to hold to
    if limit is not None and max_seq_len > limit:
        raise UserError(f"--max_seq_len {max_seq_len}: beyond the {limit} tokens {name} attends to")


def begin_outputs(run: RunArgs, model_dirs: tuple[str, ...] = ()) -> logging.Logger:
    """Once the inputs are known good: clear a run being overwritten (with the model directories the step
    writes, ``model_dirs``: step 3's), then log to OUTPUT_DIR/training.log.

    Called after data and flags are validated, so bad input never leaves an output directory behind.
    """
    if run.overwrite:
        clear_previous_run(run.output_dir, model_dirs)
    if dist.local_rank() == 0:  # each node's train.py (torchrun: training.nodeN.log) named its own file
        adopt_pending_log()  # train.py's log of this step replaces the earlier run's now
    dist.barrier()
    return setup_logging(run.output_dir)


@dataclass
class Batches:
    loader: Any  # resumable, rank-sharded training DataLoader
    evals: list  # this rank's (batch, weight) evaluation batches
    total_steps: int  # optimizer steps of the run
    global_batch: int  # samples per optimizer step over all ranks

    def __iter__(self):  # loader, evals, total_steps, global_batch = batches
        return iter((self.loader, self.evals, self.total_steps, self.global_batch))


def begin_step(
    step: int, args: tuple, run: RunArgs, setup: StepSetup, batches: Batches, data, mined=None
) -> dict[str, Any]:
    """Once the inputs are known good and the model has taken its flags (called after the engine is built:
    a flag refused by the model must not have cleared a finished run under --overwrite), the outputs begin
    (:func:`begin_outputs`) with every option of step 1 or 2 plus what was resolved from them (returned
    for the metrics loggers) and the on-policy pairs ``mined`` from a policy, if any."""
    begin_outputs(run)
    if mined:
        mined.write(run.output_dir)
    resolved = {
        "step": step, **to_dict(*args), "resolved_model_path": setup.model_path,
        "input_runs": input_runs(setup.model_path), "resolved_dtype": setup.dtype,
        "world_size": setup.world, "global_batch_size": batches.global_batch, "total_steps": batches.total_steps,
        "data": data.stats, "data_cache_hit": data.cache_hit,
    }  # fmt: skip
    save_resolved_config(run.output_dir, resolved, resume=run.resume)
    return resolved


def example_length(example: dict) -> int:
    """Padded width an example needs: its tokens (SFT) or its longer side (a preference pair)."""
    if "input_ids" in example:
        return len(example["input_ids"])
    return max(len(example["chosen"]), len(example["rejected"]))


def make_batches(data, optim: OptimArgs, collate, seed: int, group_by_length: bool = False) -> Batches:
    """Training loader (with ``group_by_length``, batches of similar length), evaluation batches and step
    counts of a prepared data set."""
    lengths = [example_length(ex) for ex in data.train] if group_by_length else None
    loader = train_loader(
        data.train, batch_size=optim.per_device_train_batch_size, seed=seed, collate=collate,
        accumulation=optim.gradient_accumulation_steps, lengths=lengths,
    )  # fmt: skip
    evals = eval_batches(data.eval, batch_size=optim.per_device_eval_batch_size, collate=collate)
    total_steps = count_total_steps(loader.sampler.batches_per_epoch(), optim, len(data.train))
    global_batch = optim.per_device_train_batch_size * optim.gradient_accumulation_steps * dist.world_size()
    return Batches(loader, evals, total_steps, global_batch)


def count_total_steps(batches_per_epoch: int, optim: OptimArgs, n_samples: int) -> int:
    """Optimizer steps of the run; refuses a data set too small for one step."""
    if batches_per_epoch < optim.gradient_accumulation_steps or batches_per_epoch == 0:
        raise UserError(
            f"{n_samples} training samples make {batches_per_epoch} micro-batches per rank, fewer than "
            f"--gradient_accumulation_steps {optim.gradient_accumulation_steps}: lower "
            "--per_device_train_batch_size or add data"
        )
    total = batches_per_epoch // optim.gradient_accumulation_steps * optim.num_train_epochs
    return min(total, optim.max_steps) if optim.max_steps else total


def describe_pairs(data, total_steps: int) -> str:
    """One log line about a step's preference pairs (reward model or DPO): counts and what was dropped."""
    st = data.stats["train"]
    return (f"data: {len(data.train)} train / {len(data.eval)} eval pairs; dropped {st['dropped_identical']} "
            f"identical, {st['dropped_empty_response']} empty, {st['dropped_too_long']} too long; "
            f"{st.get('prompt_truncated', 0)} prompts truncated; {total_steps} steps")  # fmt: skip
