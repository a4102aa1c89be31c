"""From a step's parsed options to a memory plan, and from the plan back to the step's flags.

``train.py`` parses each step's final command line with that step's own parser, then asks this module
which ZeRO stage, offload and gradient checkpointing fit the devices (``--estimate-memory`` prints
the whole table; a normal run adds the chosen flags that the user did not set). The estimator maths
is in :mod:`dschat.memory`; nothing here imports deepspeed.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from dschat import memory as M
from dschat.config import (
    DataArgs,
    DPOArgs,
    LoraArgs,
    ModelArgs,
    OptimArgs,
    PPOArgs,
    RLHFEngineArgs,
    one_update_per_round,
    step3_models,
)
from dschat.models.shapes import ModelShape, load_model_config, shape_from_config
from dschat.utils.errors import UserError

STEP_NAMES = {1: "supervised fine-tuning", 2: "reward model", 3: "RLHF (PPO)"}

# The flags each step uses for the three choices (step 3 sets actor and critic alike).
STAGE_FLAGS = {1: ("--zero_stage",), 2: ("--zero_stage",), 3: ("--actor_zero_stage", "--critic_zero_stage")}
OFFLOAD_FLAGS = {1: ("--offload",), 2: ("--offload",), 3: ("--offload",)}
ZERO3_OFFLOAD_EXTRA = {3: ("--offload_reference_model", "--offload_reward_model")}
CKPT_FLAGS = {
    1: ("--gradient_checkpointing",),
    2: ("--gradient_checkpointing",),
    3: ("--actor_gradient_checkpointing", "--critic_gradient_checkpointing"),
}


def given(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (the last one, as argparse keeps), ``""`` for a switch, else None."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = "" if nxt.startswith("--") else nxt
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def switch(argv: list[str], flag: str) -> bool | None:
    """A switch as ``argv`` sets it: True for ``--X``, False for ``--no_X`` (the last one wins, as
    argparse keeps), None if neither is there."""
    off = "--no_" + flag.removeprefix("--")
    value = None
    for tok in argv:
        if tok in (flag, off):
            value = tok == flag
    return value


def fixed_choice(step: int, argv: list[str]) -> dict[str, Any]:
    """The choice fields the step's command line already decides (explicit flags always win).

    Step 3 plans actor and critic with one choice; where its flags set them apart (``--actor_zero_stage 3
    --critic_zero_stage 0``, checkpointing for one of them), the estimate takes the setting that needs more
    memory for both (the lower stage, no checkpointing): an estimate above the need, never one below it.
    Where they set one model's stage alone, the other's is the plan's, at most that one
    (``zero_stage_at_most``); one model's checkpointing on leaves the other's to the plan (off still fixes
    both): a flag for one model is not imposed on the other.
    """
    fixed: dict[str, Any] = {}
    stages = [int(s) for s in (given(argv, f) for f in STAGE_FLAGS[step]) if s is not None]
    if stages:
        fixed["zero_stage" if len(stages) == len(STAGE_FLAGS[step]) else "zero_stage_at_most"] = min(stages)
    for name, flags in (("offload", OFFLOAD_FLAGS[step]), ("gradient_checkpointing", CKPT_FLAGS[step])):
        values = [v for v in (switch(argv, f) for f in flags) if v is not None]
        if values and (len(values) == len(flags) or not all(values)):
            fixed[name] = all(values)
    return fixed


def ckpt_flags(step: int, critic: bool = True) -> tuple[str, ...]:
    """The step's gradient-checkpointing switches: step 3 without a critic (a critic-free estimator) has
    the actor's alone (it refuses the critic's, which nothing would read)."""
    return tuple(f for f in CKPT_FLAGS[step] if critic or not f.startswith("--critic_"))


def choice_flags(step: int, choice: M.Choice, argv: list[str], critic: bool = True) -> list[str]:
    """Flags that make the step run ``choice``, leaving out what ``argv`` already says (``critic``: whether
    step 3 trains one)."""
    out: list[str] = []
    for flag in STAGE_FLAGS[step]:
        if given(argv, flag) is None and choice.zero_stage != 0:
            out += [flag, str(choice.zero_stage)]
    switches = list(OFFLOAD_FLAGS[step]) if choice.offload else []
    if choice.offload and choice.zero_stage == 3:
        switches += ZERO3_OFFLOAD_EXTRA.get(step, ())
    if choice.gradient_checkpointing:
        switches += ckpt_flags(step, critic)
    return out + [f for f in switches if switch(argv, f) is None]


def resumed_flags(step: int, saved: dict[str, Any], argv: list[str], critic: bool = True) -> list[str]:
    """The flags that make a resumed step place its models as the interrupted run did (``saved``: its
    ``dschat_config.json``), those ``argv`` leaves out: each model's ZeRO stage, checkpointing and offload
    from its own section in step 3 (``actor``, ``critic``), where the two may differ (a critic's ZeRO-0
    checkpoint does not load into a ZeRO-3 engine)."""
    out: list[str] = []
    for key, flags in (("zero_stage", STAGE_FLAGS[step]), ("gradient_checkpointing", ckpt_flags(step, critic)),
                       ("offload", OFFLOAD_FLAGS[step] + ZERO3_OFFLOAD_EXTRA.get(step, ()))):  # fmt: skip
        for flag in flags:
            name = flag[2:]
            model = name.split("_", 1)[0] if step == 3 and name.startswith(("actor_", "critic_")) else None
            if model:  # step 3 keeps each model's options under its name
                value = saved[model][name.removeprefix(f"{model}_")]
            else:  # one step's own, step 3's shared --offload (in each section) or an engine switch
                value = saved[name] if name in saved else saved["actor"][name]
            if key == "zero_stage":
                out += [flag, str(value)] if given(argv, flag) is None else []
            elif value and switch(argv, flag) is None:
                out.append(flag)
    return out


def ordered_choices(fixed: dict[str, Any], on_gpu: bool, devices: int = 2) -> list[M.Choice]:
    """The choices to weigh, fastest first: :data:`dschat.memory.CANDIDATES`, or with some fields fixed
    by flags every combination that has them. Offload is left out on CPU-only machines unless asked for;
    on a single device ZeRO 1-3 without offload partition nothing and are left out unless asked for."""
    grid = [M.Choice(s, o, g) for s, o, g in itertools.product(range(4), (False, True), (False, True))]
    grid = [c for c in grid if not (c.zero_stage == 0 and c.offload)] if fixed else list(M.CANDIDATES)
    if devices == 1 and "zero_stage" not in fixed:
        grid = [c for c in grid if c.zero_stage == 0 or c.offload]
    rank = {c: i for i, c in enumerate(M.CANDIDATES)}
    order = {c: rank.get(c, len(rank) + i) for i, c in enumerate(grid)}
    grid.sort(key=order.__getitem__)
    at_most = fixed.get("zero_stage_at_most", 3)
    exact = {k: v for k, v in fixed.items() if k != "zero_stage_at_most"}
    out = [c for c in grid if c.zero_stage <= at_most and all(getattr(c, k) == v for k, v in exact.items())]
    if not on_gpu and not fixed.get("offload"):
        out = [c for c in out if not c.offload]
    return out


# ---------------------------------------------------------------------------------------------- hardware
def physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect_hardware(gpus_per_node: int, nodes: int, device_memory_gib: float | None = None,
                    cpu_memory_gib: float | None = None) -> M.Hardware:  # fmt: skip
    """This machine's devices (or the ones given): GPU memory via torch.cuda, else the CPU's RAM.

    ``--device-memory`` plans for GPUs of that size from any machine (a laptop planning a cluster); from a
    machine without GPUs, the nodes' CPU RAM is then unknown unless ``--cpu-memory`` gives it."""
    import torch

    cuda = torch.cuda.is_available()
    if device_memory_gib is not None:
        device = int(device_memory_gib * M.GIB)
    elif cuda:
        device = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        device = None
    if cpu_memory_gib is not None:
        cpu = int(cpu_memory_gib * M.GIB)
    elif device_memory_gib is not None and not cuda:
        # GPUs planned from a machine without any (a laptop planning a cluster): this machine's RAM says
        # nothing of the cluster's nodes, so the CPU side is not judged (--cpu-memory gives it)
        cpu = None
    else:
        cpu = physical_ram()
    return M.Hardware(gpus_per_node, nodes, cuda or device_memory_gib is not None, device, cpu)


def resolve_plan_dtype(dtype: str, on_gpu: bool) -> str:
    """``auto`` as the step will resolve it here (:func:`dschat.engine.core.auto_dtype`); for GPUs planned
    from a machine without one, bf16 (a bf16-capable GPU is assumed)."""
    if dtype != "auto":
        return dtype
    import torch

    from dschat.engine.core import auto_dtype  # torch only; no deepspeed import

    if on_gpu and not torch.cuda.is_available():  # planning GPUs from a machine without one
        return "bf16"
    return auto_dtype()


# ---------------------------------------------------------------------------------------------- workloads
@dataclass
class StepPlan:
    step: int
    models: list[tuple[str, str, ModelShape, str]]  # (role, name, shape, where its config came from)
    dtype: str
    workload: Any  # TrainWorkload | RLHFWorkload
    estimates: list[M.Estimate]
    chosen: M.Estimate | None
    reason: str
    fixed: dict[str, Any]
    hw: M.Hardware


def _of(groups: tuple, cls: type) -> list:
    return [g for g in groups if isinstance(g, cls)]


def estimate(work: Any, choice: M.Choice, hw: M.Hardware) -> M.Estimate:
    if isinstance(work, M.RLHFWorkload):
        return M.estimate_rlhf(work, choice, hw)
    return M.estimate_train(work, choice, hw)


def make_plan(step: int, groups: tuple, argv: list[str], hw: M.Hardware, shapes: dict[str, str] | None = None,
              flags: dict[str, str] | None = None) -> StepPlan:  # fmt: skip
    """Plan one step from its parsed option groups (``groups``, as the step's parser returns them) and
    its command line ``argv`` (which flags are explicit).

    ``shapes`` maps a model role (``actor``, ``critic``, ``model``) to the model to plan with instead of
    the path in the options, for a model an earlier step of the same run has not written yet. ``flags``
    maps a role to the flag an error about its model should name (train.py's ``--actor-model``).
    """
    shapes, flags = shapes or {}, flags or {}

    def shape(role: str, name: str, flag: str) -> tuple[str, str, ModelShape, str]:
        name, flag = shapes.get(role, name), flags.get(role, flag)
        cfg, where = load_model_config(name, flag)
        return role, name, shape_from_config(cfg, f"{flag} {name}"), where

    data = _of(groups, DataArgs)[0]
    model_args = _of(groups, ModelArgs)
    loras = _of(groups, LoraArgs)
    dtype = resolve_plan_dtype(model_args[0].dtype, hw.on_gpu)
    w = M.dtype_bytes(dtype)
    if step in (1, 2):
        optim = _of(groups, OptimArgs)[0]
        dpo = _of(groups, DPOArgs)  # step 2 as DPO: the policy keeps its LM head
        role = shape("model", model_args[0].model_name_or_path, "--model_name_or_path")
        models = [role]
        ref = None
        if dpo and dpo[0].ref_model_name_or_path:
            models.append(shape("reference", dpo[0].ref_model_name_or_path, "--ref_model_name_or_path"))
            ref = models[-1][2]
        work: Any = M.TrainWorkload(role[2], optim.per_device_train_batch_size, data.max_seq_len, w,
                                    head="lm" if step == 1 or dpo else "score", lora_dim=loras[0].lora_dim,
                                    only_lora=loras[0].only_optimize_lora, pairs=step == 2, reference=ref,
                                    trainable_layers=model_args[0].trainable_layers)  # fmt: skip
    else:
        eng, ppo = _of(groups, RLHFEngineArgs)[0], _of(groups, PPOArgs)[0]
        actor = shape("actor", model_args[0].model_name_or_path, "--actor_model_name_or_path")
        critic = shape("critic", model_args[1].model_name_or_path, "--critic_model_name_or_path")
        held = step3_models(eng, ppo)  # what the step builds, described once
        judge = shape("judge", eng.judge_reward_model, "--judge_reward_model") if held.judge else None
        own_reward = held.reward_model and eng.reward_model_name_or_path  # else it is the critic's model
        reward = (
            shape("reward", eng.reward_model_name_or_path, "--reward_model_name_or_path")
            if own_reward
            else None
        )
        work = M.RLHFWorkload(
            actor[2], critic[2], ppo.per_device_generation_batch_size, ppo.per_device_training_batch_size,
            ppo.max_prompt_seq_len, ppo.max_answer_seq_len, w, actor_lora_dim=loras[0].lora_dim,
            critic_lora_dim=loras[1].lora_dim, only_lora=loras[0].only_optimize_lora, reference=held.reference,
            actor_trainable_layers=model_args[0].trainable_layers, critic_trainable_layers=model_args[1].trainable_layers,
            reward_model=held.reward_model, offload_reference=switch(argv, "--offload_reference_model"),
            offload_reward=switch(argv, "--offload_reward_model"), critic_trained=held.critic, judge=judge[2] if judge else None,
            samples_per_prompt=ppo.n_samples_per_prompt, inference_copy=held.inference_copy, reward=reward[2] if reward else None,
            inference_tp_size=held.inference_tp_size, share_frozen_trunk=ppo.share_frozen_trunk,
            one_update_per_round=one_update_per_round(ppo, model_args[0], loras[0], zero_stage=0),
            critic_one_update_per_round=one_update_per_round(ppo, model_args[1], loras[1], zero_stage=0),
            ptx_seq_len=data.max_seq_len if ppo.unsupervised_dataset_name else 0,
            gather_layers=eng.tp_gather_partition_size, ema=eng.enable_ema, kept_kv_cache=held.kept_kv_cache,
        )  # fmt: skip
        models = [actor, critic, *([reward] if reward else []), *([judge] if judge else [])]
    fixed = fixed_choice(step, argv)
    choices = ordered_choices(fixed, hw.on_gpu, hw.gpus_per_node * hw.nodes)
    if not choices:
        raise UserError(
            f"step {step}: conflicting flags ({fixed}): no ZeRO stage / offload combination has them"
        )
    estimates = [estimate(work, c, hw) for c in choices]
    chosen, reason = M.plan(estimates, hw)
    return StepPlan(step, models, dtype, work, estimates, chosen, reason, fixed, hw)


# ---------------------------------------------------------------------------------------------- printing
def describe_hardware(hw: M.Hardware) -> str:
    nodes = f"{hw.nodes} node{'s' if hw.nodes != 1 else ''}"
    if hw.on_gpu:
        each = f" ({M.gib(hw.device_bytes)} GiB each)" if hw.device_bytes else " (memory unknown)"
        cpu = f", {M.gib(hw.cpu_node_bytes)} GiB CPU RAM per node" if hw.cpu_node_bytes else ""
        return f"{nodes} x {hw.gpus_per_node} GPU{'s' if hw.gpus_per_node != 1 else ''}{each}{cpu}"
    return (f"{nodes} x {hw.gpus_per_node} CPU process{'es' if hw.gpus_per_node != 1 else ''} sharing "
            f"{M.gib(hw.cpu_node_bytes or 0)} GiB RAM per node")  # fmt: skip


def format_plan(p: StepPlan, full: bool) -> str:
    """The plan as text: models, workload, and (``full``) one row per choice with the chosen one marked."""
    w = p.workload
    dpo = isinstance(w, M.TrainWorkload) and w.pairs and w.head == "lm"
    lines = [f"step {p.step} ({'DPO' if dpo else STEP_NAMES[p.step]}), {p.dtype}, {describe_hardware(p.hw)}"]
    for role, name, shape, where in p.models:
        head = (
            "score"
            if role in ("critic", "judge") or (role == "model" and p.workload.head == "score")
            else "lm"
        )
        lines.append(f"  {role}: {name}, {M.human_params(shape.parameters(head))} parameters "
                     f"({shape.model_type}, {shape.num_layers} layers x {shape.hidden_size}; config: {where})")  # fmt: skip
    if isinstance(w, M.RLHFWorkload):
        lines.append(f"  generation {w.generation_batch} prompts x ({w.prompt_len} + {w.answer_len}) tokens, "
                     f"PPO micro-batch {w.training_batch}" + ("" if w.reference else ", reference shared with the actor")
                     + ("" if w.reward_model else ", no reward model (reward function)"))  # fmt: skip
    else:
        pairs = " pairs (chosen + rejected)" if w.pairs else ""
        lora = f", LoRA rank {w.lora_dim}{' only' if w.only_lora else ''}" if w.lora_dim else ""
        lines.append(f"  micro-batch {w.batch}{pairs} x {w.seq} tokens (--max_seq_len){lora}")
    if p.fixed:
        lines.append(
            "  fixed by the flags (yours or the preset's): "
            + ", ".join(f"{k}={v}" for k, v in p.fixed.items())
        )
    unit = "GPU" if p.hw.on_gpu else "process"
    if full:
        lines.append(
            f"  {'ZeRO':>4} {'offload':>7} {'grad-ckpt':>9} {'GiB/' + unit:>12} {'CPU GiB/node':>13}  fits"
        )
        for e in p.estimates:
            c, fit = e.choice, e.fits(p.hw)
            mark = " <- choice" if p.chosen is not None and e.choice == p.chosen.choice else ""
            lines.append(f"  {c.zero_stage:>4} {'yes' if c.offload else 'no':>7} "
                         f"{'yes' if c.gradient_checkpointing else 'no':>9} {M.gib(e.device):>12} "
                         f"{M.gib(e.cpu_node):>13}  {'?' if fit is None else 'yes' if fit else 'no'}{mark}")  # fmt: skip
    if p.chosen is not None:
        parts = " + ".join(f"{k} {M.gib(v)}" for k, v in p.chosen.parts.items())
        lines.append(f"  choice: {p.chosen.choice.describe()}: {p.reason}")
        lines.append(f"  per {unit} (GiB): {parts}")
    return "\n".join(lines)
