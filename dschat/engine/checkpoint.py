"""Resumable DeepSpeed checkpoints written atomically, and export to Hugging Face format.

Layout of ``root`` (``OUTPUT_DIR/checkpoints``)::

    step200/        a complete DeepSpeed checkpoint (every rank's shards)
    step400/
    latest          "step400", replaced atomically after step400/ is complete

A save goes to ``.tmp-stepN/`` first; only when every rank has finished and its files are on the disk
does rank 0 rename it and then update ``latest``. A run killed mid-save (or a power loss) therefore
leaves ``latest`` naming the previous, complete checkpoint. With ``--node_local_storage`` every node
keeps this layout on its own disk (its ranks' shards, written by DeepSpeed by local rank), managed by the
node's local rank 0.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.io import (
    INCOMPLETE_EXPORT,
    atomic_save_tensors,
    atomic_write_text,
    fsync_tree,
    replace_dir,
    usual_mode,
)

LOG = logging.getLogger("dschat")
TAG_RE = re.compile(r"^step(\d+)$")


def save_checkpoint(engine, root: str | Path, step: int, client_state: dict[str, Any], keep: int = 2,
                    tensors: dict[str, dict[str, torch.Tensor] | None] | None = None) -> Path:  # fmt: skip
    """Save one engine (``root/stepN/``) or several (a dict name -> engine: ``root/stepN/<name>/``).

    ``client_state`` goes with the (first) engine; a per-rank ``rng_rank<R>.pt`` with the torch RNG
    state is saved beside it, so that sampling after a resume continues exactly. ``tensors``: state kept
    outside the engines (name -> tensors, held by the writing rank: the actor's EMA), each in
    ``<name>.safetensors`` (:func:`load_checkpoint_tensors`).
    """
    root = Path(root)
    tag, tmp_tag = f"step{step}", f".tmp-step{step}"
    if dist.is_node_writer():
        # what a killed save left (of this step or another): one save runs at a time, nothing reads these
        for stale in root.glob(".tmp-step*") if root.is_dir() else ():
            shutil.rmtree(stale, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if isinstance(engine, dict):
        for i, (name, eng) in enumerate(engine.items()):
            eng.save_checkpoint(
                str(root / tmp_tag), tag=name, client_state=client_state if i == 0 else {}, save_latest=False
            )
    else:
        engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    for name, held in (tensors or {}).items():
        if held is not None and dist.is_node_writer():
            atomic_save_tensors(root / tmp_tag / f"{name}.safetensors", held)
    rng = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    torch.save(rng, root / tmp_tag / f"rng_rank{dist.rank()}.pt")
    # DeepSpeed and torch.save write without fsync: each node's first rank flushes the files before ``latest``
    # may name the checkpoint (on shared storage another node's writes sit in that node's cache, so one
    # per node; one per rank would be ranks x files round trips to a parallel filesystem's server)
    dist.barrier()  # every rank's files written
    if dist.local_rank() == 0:
        fsync_tree(root / tmp_tag)
    dist.barrier()
    if dist.is_node_writer():
        replace_dir(root / tmp_tag, root / tag)
        atomic_write_text(root / "latest", tag + "\n")
        steps = sorted(int(m[1]) for p in root.iterdir() if (m := TAG_RE.match(p.name)) and p.is_dir())
        # checkpoints past this one are an abandoned continuation's (a resume from an earlier one): they go,
        # and the newest ``keep`` up to this one stay, this one always among them
        past = [s for s in steps if s > step]
        for old in past + [s for s in steps if s <= step][:-keep]:
            shutil.rmtree(root / f"step{old}", ignore_errors=True)
    dist.barrier()
    return root / tag


def latest_tag(root: str | Path) -> str | None:
    """The tag named by ``root/latest`` if that checkpoint directory is complete, else None."""
    root = Path(root)
    try:
        tag = (root / "latest").read_text().strip()
    except OSError:
        return None
    return tag if TAG_RE.match(tag) and (root / tag).is_dir() else None


def agreed_latest_tag(root: str | Path) -> str | None:
    """:func:`latest_tag`, the same on every rank or a :class:`UserError` on every rank (collective). With
    ``--node_local_storage`` each node reads its own ``latest``, and a node stopped between its peers'
    saves names an older checkpoint, or none: resuming from different steps would go on with different
    weights (ZeRO-0/1/2) or leave the ranks with a checkpoint waiting for the others in the load."""
    tag = latest_tag(root)
    step = int(TAG_RE.match(tag)[1]) if tag is not None else -1
    neg_low, high = dist.all_reduce_max([-step, step])
    if -neg_low != high:
        low = "none" if neg_low == 1 else f"step{int(-neg_low)}"
        raise UserError(
            f"--resume: the ranks' latest checkpoints differ ({low} on some, step{int(high)} on others; with "
            "--node_local_storage each node keeps its own): give every node the same checkpoint, or start over "
            "with --overwrite"
        )
    return tag


def load_checkpoint(engine, root: str | Path, tag: str) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote (one engine or a dict of them); returns the client state."""
    root = Path(root)
    targets = engine.items() if isinstance(engine, dict) else [(None, engine)]
    client: dict[str, Any] = {}
    for i, (name, eng) in enumerate(targets):
        load_dir, load_tag = (root / tag, name) if name is not None else (root, tag)
        path, state = eng.load_checkpoint(
            str(load_dir), tag=load_tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {load_dir}/{load_tag}")
        if i == 0:
            client = state or {}
    rng_file = root / tag / f"rng_rank{dist.rank()}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return client


def load_checkpoint_tensors(root: str | Path, tag: str, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors :func:`save_checkpoint` kept under ``name`` in checkpoint ``tag``; None if it has none."""
    from safetensors.torch import load_file

    path = Path(root) / tag / f"{name}.safetensors"
    return load_file(str(path)) if path.exists() else None


def _is_zero3_param(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def gather_full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unpartitioned) state dict as CPU tensors on the writing rank (rank 0, or every node's
    local rank 0 with node-local storage); None on other ranks.

    ZeRO-3 parameters are gathered one at a time, so peak extra memory is one parameter, not the model.
    """
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    main = dist.is_node_writer()
    for name, p in module.named_parameters():
        if _is_zero3_param(p):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if main:
                    out[name] = p.data.detach().to("cpu", copy=True)
        elif main:
            out[name] = p.detach().to("cpu", copy=True)
    persistent = set(module.state_dict().keys())
    for name, b in module.named_buffers():
        if main and name in persistent:
            out[name] = b.detach().to("cpu", copy=True)
    return out if main else None


def unwrap_peft(module: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """(base transformers model, peft LoraConfig or None)."""
    peft_config = getattr(module, "peft_config", None)
    if peft_config:
        return module.get_base_model(), peft_config["default"]
    return module, None


def export_hf_model(
    module: torch.nn.Module, tokenizer, out_dir: str | Path, *, extra_files: dict[str, str] | None = None
) -> None:
    """Write ``module`` (LoRA merged in) as a Hugging Face model directory loadable by ``from_pretrained``.

    Files are written into a temporary directory beside ``out_dir`` and then moved in one by one with
    ``os.replace``; the weights are moved before ``config.json`` so a reader never pairs a new config
    with missing weights. Collective: call on every rank (ZeRO-3 gathers).
    """
    write_hf_model(module, gather_full_state_dict(module), tokenizer, out_dir, extra_files=extra_files)
    dist.barrier()


def _merged_skeleton(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of ``module``'s class holding ``state``'s own tensors, LoRA merged in, ready to save.

    Built on the meta device and filled with ``assign``: an ordinary construction would first initialise
    every weight at random in fp32 (seconds, and a second full copy of the model beside the gathered
    state: 4 more bytes per parameter at the end of a run that may just fit) only to overwrite them.
    Buffers that the state dict does not carry (a rotary embedding's frequencies) come from ``module``;
    ``state`` itself is left as it was."""
    base, lora_cfg = unwrap_peft(module)
    config = copy.deepcopy(base.config)
    config.use_cache = True
    tied = getattr(config, "tie_word_embeddings", False)
    # A tied LM head with its own adapter: merged, it is the embedding plus the adapter's delta, no longer
    # the embedding, so it is written untied (as the hybrid engine's inference copy keeps it); merging into
    # the shared weight would change the input embedding too.
    head_adapted = tied and lora_cfg is not None and any("lm_head" in k and "lora_" in k for k in state)
    if head_adapted:
        config.tie_word_embeddings = False
    with torch.device("meta"):
        skeleton = type(base)(config)
        if lora_cfg is not None:
            from peft import get_peft_model

            skeleton = get_peft_model(skeleton, copy.deepcopy(lora_cfg))
    missing, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and "lm_head" in k)]
    if missing or unexpected:
        raise RuntimeError(
            f"export: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    inner = skeleton.get_base_model() if lora_cfg is not None else skeleton
    if head_adapted:  # the head's base weight is the embedding's (the tied state holds it once), a copy
        head = inner.get_output_embeddings()
        head.base_layer.weight = torch.nn.Parameter(
            inner.get_input_embeddings().weight.detach().clone(), requires_grad=False
        )
    else:
        inner.tie_weights()  # assign broke the tie
    live = dict(module.named_buffers())
    for name, buf in list(skeleton.named_buffers()):
        if buf.is_meta and name in live:  # one that is not stays meta and is reported below
            owner, _, attr = name.rpartition(".")
            holder = skeleton.get_submodule(owner) if owner else skeleton
            holder._buffers[attr] = live[name].detach().to("cpu", copy=True)
    if lora_cfg is not None:
        # safe_merge adds each adapter into a copy of its base weight: in place it would write into the
        # caller's state (an EMA exports its live copy), merging the adapter again at the next export
        skeleton = skeleton.merge_and_unload(safe_merge=True)
    left = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"export: {len(left)} tensor(s) not filled ({', '.join(left[:3])})")
    # the checkpoint's own generation settings (Llama 3's and Qwen2.5's EOS lists, sampling defaults): the
    # skeleton built from the config would save a generation config rebuilt from config.json instead
    if getattr(base, "generation_config", None) is not None:
        skeleton.generation_config = copy.deepcopy(base.generation_config)
    # the training dtype of the live model, also for a state kept in fp32 (an EMA of a bf16 actor)
    first = next(base.parameters(), None)
    dtype = first.dtype if first is not None else next(iter(state.values())).dtype if state else torch.float32
    return skeleton.to(dtype)


# What a Hugging Face model directory may hold besides config.json: weights (one file or shards and their
# index), tokenizer files, the chat template, the generation config, a peft adapter. The run directory of
# steps 1 and 2 holds the model beside the run's own files (metrics, summary), so only these are touched.
MODEL_FILE_PATTERNS = ("model.safetensors", "model-*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                       "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                       "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                       "chat_template.json", "generation_config.json", "adapter_config.json", "adapter_model.safetensors")  # fmt: skip


def remove_stale_model_files(out_dir: Path, keep: set[str]) -> None:
    """Delete the model files in ``out_dir`` that an export writing ``keep`` does not replace: an earlier
    export's chat template would otherwise be read with a tokenizer that has none, and a single
    ``model.safetensors`` would shadow a new sharded checkpoint."""
    for pattern in MODEL_FILE_PATTERNS:
        for f in out_dir.glob(pattern):
            if f.name not in keep and f.is_file():
                f.unlink()


def write_hf_model(module: torch.nn.Module, state: dict[str, torch.Tensor] | None, tokenizer, out_dir: str | Path,
                   *, extra_files: dict[str, str] | None = None) -> None:  # fmt: skip
    """The writing rank: write ``state`` (a full state dict of ``module``'s structure) as a merged HF model."""
    if dist.is_node_writer():
        skeleton = _merged_skeleton(module, state)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".export-*"):  # a killed export's whole model; one export runs at a time
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
        try:
            if dist.rank() != 0 and hasattr(skeleton, "should_save_on_this_rank"):
                # transformers writes only on global rank 0 while torch.distributed is up; with node-local
                # storage every node's local rank 0 writes its own copy of this (unpartitioned) skeleton
                skeleton.should_save_on_this_rank = lambda is_main_process: is_main_process
            skeleton.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            files = sorted(tmp.iterdir(), key=lambda p: p.name == "config.json")
            new = {f.name for f in files}
            marker = out_dir / INCOMPLETE_EXPORT
            marker.write_text("an export is moving its files in; a directory with this file is incomplete\n")
            for f in files:
                usual_mode(f)
                if f.name == "config.json":  # last: before it, what an earlier export left and this one lacks
                    remove_stale_model_files(out_dir, keep=new)
                os.replace(f, out_dir / f.name)
            marker.unlink()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
