"""The inference copy the hybrid engine generates with: a plain transformers model of the actor's
architecture (no ZeRO-3 hooks, no peft wrappers), built once and refilled from the training weights
each round with LoRA merged in, optionally tensor-parallel (each rank holds 1/K of every attention and
MLP matrix).

Pure torch/transformers: the ZeRO-3 gathering is passed in as a context manager (:data:`Gather`:
``gather(params)`` makes the full values of ``params`` readable; the engine's is
:func:`dschat.engine.core.gather_zero3`).

Tensor parallelism is plain slicing plus ``torch.distributed.all_reduce`` after the row-parallel
layers (Megatron's split: q/k/v, gate/up, fc1 by output features; o/down, fc2 by input features),
because it needs nothing from the backend beyond all-reduce (gloo on CPU works) and adds no per-op
dispatch cost. Attention heads follow from the column split: the models reshape with ``-1`` heads
(OPT and GPT-2 keep a head count or split size, which is divided here).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dschat.models.attention import FAST_ATTENTION, register_fast_attention
from dschat.models.layers import contiguous_head_input

LOG = logging.getLogger("dschat")

# gather(params) -> a context manager inside which the full values of params are readable
Gather = Callable[[list[nn.Parameter]], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class ArchPlan:
    """Where an architecture keeps its decoder blocks and how its matrices split across TP ranks.

    Names inside a block are relative to the block (``self_attn.q_proj``).
    """

    layers: str  # the ModuleList of decoder blocks
    colwise: tuple[str, ...]  # split by output features (heads / intermediate units)
    rowwise: tuple[str, ...]  # split by input features; their outputs are summed over the group
    fused: tuple[tuple[str, int], ...] = ()  # colwise modules made of k equal blocks (GPT-2's c_attn = q|k|v)
    divide_attrs: tuple[tuple[str, str], ...] = ()  # (module in block, attribute) that counts heads/features
    head_counts: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads")  # config fields split by K
    conv1d: bool = False  # transformers Conv1D: weight stored as (in, out)


_LLAMA_LIKE = ArchPlan(
    layers="model.layers",
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
)
# Qwen3 and Gemma 2 take Llama's split: their attention reshapes by head_dim with -1 heads, so a rank's
# slice of q/k/v is a whole number of heads; Qwen3's per-head q/k norms and Gemma 2's norms stay whole.
PLANS: dict[str, ArchPlan] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "opt": ArchPlan(
        layers="model.decoder.layers",
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
        rowwise=("self_attn.out_proj", "fc2"),
        divide_attrs=(("self_attn", "num_heads"),),
        head_counts=("num_attention_heads",),
    ),
    "gpt2": ArchPlan(
        layers="transformer.h",
        colwise=("attn.c_attn", "mlp.c_fc"),
        rowwise=("attn.c_proj", "mlp.c_proj"),
        fused=(("attn.c_attn", 3),),
        divide_attrs=(("attn", "num_heads"), ("attn", "split_size")),
        head_counts=("n_head",),
        conv1d=True,
    ),
}


class UnsupportedModel(Exception):
    """The actor cannot be served by an inference copy (the caller falls back to plain generation)."""


def plan_for(model: nn.Module, tp_size: int = 1) -> ArchPlan:
    """How ``model``'s copy is built. Tensor parallelism needs the architecture's split (:data:`PLANS`);
    without it any architecture is copied whole, its decoder blocks found by :func:`decoder_blocks`
    (they only group the ZeRO-3 gathering), so a new model keeps the fast path."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PLANS:
        return PLANS[model_type]
    if tp_size > 1:
        raise UnsupportedModel(f"architecture {model_type!r} has no tensor-parallel split (planned: "
                               f"{', '.join(sorted(PLANS))}); --inference_tp_size 1 serves any architecture")  # fmt: skip
    return ArchPlan(layers=decoder_blocks(model), colwise=(), rowwise=())


def decoder_blocks(model: nn.Module) -> str:
    """The name of ``model``'s ModuleList of decoder blocks: the first one with as many entries as the
    config has layers ("" where there is none: the copy is then gathered in one piece)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return name
    return ""


# ---------------------------------------------------------------------------------------------- pure maths
@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of the copy is cut from the full tensor: ``dim`` split into ``size`` parts
    (each of ``blocks`` equal blocks separately); ``replicate_bias=False`` keeps a row-parallel bias
    on group rank 0 only (it must be added once to the summed output)."""

    dim: int | None
    blocks: int = 1
    rank0_only: bool = False


def shard_spec(name: str, plan: ArchPlan, tp_size: int) -> ShardSpec:
    """The split of parameter ``name`` (full name in the copy) under TP degree ``tp_size``."""
    if tp_size == 1 or not name.startswith(plan.layers + "."):
        return ShardSpec(None)
    rest = name[len(plan.layers) + 1 :].split(".", 1)[1]  # drop the block index
    module, _, pname = rest.rpartition(".")
    blocks = dict(plan.fused).get(module, 1)
    out_dim, in_dim = (1, 0) if plan.conv1d else (0, 1)
    if module in plan.colwise:
        return ShardSpec(out_dim if pname == "weight" else 0, blocks)
    if module in plan.rowwise:
        return ShardSpec(in_dim, 1) if pname == "weight" else ShardSpec(None, 1, rank0_only=True)
    return ShardSpec(None)


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` (a view where possible). Shapes: ``full.shape[dim]`` must be a
    multiple of ``size * blocks``; the part has ``full.shape[dim] / size`` along ``dim``."""
    if spec.dim is None or size == 1:
        return full
    n = full.shape[spec.dim]
    if n % (size * spec.blocks):
        raise ValueError(f"dimension {n} does not split into {size} x {spec.blocks} equal parts")
    parts = full.chunk(spec.blocks, dim=spec.dim)
    local = [p.chunk(size, dim=spec.dim)[rank] for p in parts]
    return local[0] if len(local) == 1 else torch.cat(local, dim=spec.dim)


def local_shape(shape: torch.Size, spec: ShardSpec, size: int) -> tuple[int, ...]:
    out = list(shape)
    if spec.dim is not None and size > 1:
        if out[spec.dim] % (size * spec.blocks):
            raise ValueError(
                f"dimension {out[spec.dim]} does not split into {size} x {spec.blocks} equal parts"
            )
        out[spec.dim] //= size
    return tuple(out)


def merged_lora_weight(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32 (W: (out, in), or (in, out) with ``fan_in_fan_out``; A: (r, in);
    B: (out, r)). The training module's own tensors are only read."""
    delta = lora_b.float() @ lora_a.float()
    if fan_in_fan_out:
        delta = delta.T
    return weight.float() + scaling * delta


# ---------------------------------------------------------------------------------------------- the copy
@dataclass
class TPGroup:
    """This rank's place in its tensor-parallel group (``group`` None: a group of one)."""

    rank: int = 0  # within the group
    size: int = 1
    group: object | None = None
    leader: int = 0  # global rank of the group's rank 0


@dataclass
class _Fill:
    """One parameter of the copy and how to compute its full value from training parameters."""

    target: nn.Parameter
    sources: list[nn.Parameter]
    compute: Callable[[], torch.Tensor]
    spec: ShardSpec
    chunk: int  # decoder block index, or -1 for everything outside the blocks
    shape: tuple[int, ...] = ()


def _is_lora_layer(m: nn.Module) -> bool:
    return hasattr(m, "base_layer") and hasattr(m, "lora_A")


def _active_lora(m: nn.Module) -> tuple[nn.Parameter, nn.Parameter, float, bool] | None:
    """(A, B, scaling, fan_in_fan_out) of a peft LoRA layer's active adapter, None if it is off."""
    if getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
        raise UnsupportedModel("a LoRA layer is disabled or already merged into its base weight")
    active = list(getattr(m, "active_adapters", []) or [])
    active = [a for a in active if a in m.lora_A]
    if not active:
        return None
    if len(active) > 1:
        raise UnsupportedModel(f"{len(active)} active LoRA adapters (one is supported)")
    name = active[0]
    if (getattr(m, "use_dora", {}) or {}).get(name) or getattr(m, "lora_bias", {}).get(name, False):
        raise UnsupportedModel("DoRA / LoRA bias adapters")
    return m.lora_A[name].weight, m.lora_B[name].weight, float(m.scaling[name]), bool(m.fan_in_fan_out)


class InferenceCopy:
    """A plain transformers model shaped like ``base`` (the training model without peft wrappers),
    in ``dtype`` on ``device``; with ``tp.size > 1`` its attention and MLP matrices are this rank's
    slices and the row-parallel outputs are all-reduced over ``tp.group``.

    Build once (``InferenceCopy(base, ...)``), then :meth:`refill` before each generation round.
    """

    def __init__(
        self,
        train_module: nn.Module,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
        fast_attention: bool = True,
    ) -> None:
        base = train_module.get_base_model() if hasattr(train_module, "get_base_model") else train_module
        self.tp = tp or TPGroup()
        self.plan = plan_for(base, self.tp.size)
        self.dtype, self.device = dtype, device
        config = copy.deepcopy(base.config)
        config.use_cache = True
        if self.tp.size > 1:
            for key in self.plan.head_counts:
                n = getattr(config, key, None)
                if n is not None and n % self.tp.size:
                    raise ValueError(
                        f"{key} = {n} is not divisible by the tensor-parallel size {self.tp.size}"
                    )
        with torch.device("meta"):
            model = type(base)(config)
        # the base is already on dschat_sdpa where the steps loaded it (dschat.models.loading)
        attn = getattr(config, "_attn_implementation", None)
        self.fast_attention = fast_attention and attn in ("sdpa", FAST_ATTENTION)
        if self.fast_attention:
            register_fast_attention()
            model.config._attn_implementation = FAST_ATTENTION
        elif attn == FAST_ATTENTION:  # asked for plain SDPA
            model.config._attn_implementation = "sdpa"
        self.model = contiguous_head_input(model).eval()
        self.fills: list[_Fill] = []
        self._materialize(base)
        self._install_all_reduce()
        self.copy_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    # ------------------------------------------------------------------ construction
    def _chunk_of(self, name: str) -> int:
        prefix = self.plan.layers + "."
        return (
            int(name[len(prefix) :].split(".", 1)[0]) if self.plan.layers and name.startswith(prefix) else -1
        )

    def _materialize(self, base: nn.Module) -> None:
        """Real tensors for every meta parameter (sliced shapes under TP; tied parameters stay tied unless
        a holder has an adapter), buffers copied from the training model (same values, e.g. its rotary
        frequencies)."""
        made: dict[int, nn.Parameter] = {}
        adapted: set[int] = set()  # tied parameters that one of their holders merges an adapter into
        size, rank = self.tp.size, self.tp.rank
        for mod_name, mod in self.model.named_modules():
            train_mod = base.get_submodule(mod_name)
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                lora = pname == "weight" and _is_lora_layer(train_mod) and _active_lora(train_mod) is not None
                if id(p) in made and not lora and id(p) not in adapted:
                    # tied (lm_head = embed_tokens): one tensor, filled once
                    mod._parameters[pname] = made[id(p)]
                    continue
                # a holder with an adapter (LoRA on a tied lm_head) gets a tensor of its own: the shared
                # one would give the other holder the adapter, or this one none
                if lora:
                    adapted.add(id(p))
                full_name = f"{mod_name}.{pname}" if mod_name else pname
                spec = shard_spec(full_name, self.plan, size)
                new = nn.Parameter(
                    torch.empty(local_shape(p.shape, spec, size), dtype=self.dtype, device=self.device),
                    requires_grad=False,
                )
                made.setdefault(id(p), new)
                mod._parameters[pname] = new
                self.fills.append(
                    self._fill_for(train_mod, pname, new, spec, self._chunk_of(full_name), rank)
                )
            for bname, b in list(mod._buffers.items()):
                if b is None:
                    continue
                src = (train_mod.base_layer if _is_lora_layer(train_mod) else train_mod)._buffers.get(bname)
                if src is None:
                    raise UnsupportedModel(
                        f"buffer {mod_name}.{bname} has no counterpart in the training model"
                    )
                mod._buffers[bname] = src.detach().to(self.device, copy=True)
            self._patch_counts(mod_name, mod, size)

    def _fill_for(self, train_mod: nn.Module, pname: str, target: nn.Parameter, spec: ShardSpec, chunk: int,
                  rank: int) -> _Fill:  # fmt: skip
        lora = None
        if _is_lora_layer(train_mod):
            lora = _active_lora(train_mod) if pname == "weight" else None
            train_mod = train_mod.base_layer
        src = train_mod._parameters.get(pname)
        if src is None:
            raise UnsupportedModel(f"parameter {pname} of {type(train_mod).__name__} is missing in training")
        shape = tuple(target.shape)
        if spec.rank0_only and rank != 0:  # a row-parallel bias is added once, by group rank 0; the
            # source stays listed so that every rank gathers the same parameters (a collective)
            return _Fill(target, [src], lambda: torch.zeros(()), spec, chunk, shape)
        if lora is None:
            return _Fill(target, [src], lambda: src.data, spec, chunk, shape)
        a, b, scaling, fan = lora
        return _Fill(target, [src, a, b], lambda: merged_lora_weight(src.data, a.data, b.data, scaling, fan),
                     spec, chunk, shape)  # fmt: skip

    def _patch_counts(self, mod_name: str, mod: nn.Module, size: int) -> None:
        """Divide the head/feature counts a sliced module keeps (OPT ``num_heads``, GPT-2 ``split_size``,
        Conv1D ``nf``) and fix ``in/out_features`` so the modules describe their sliced weights."""
        if size == 1 or not mod_name.startswith(self.plan.layers + "."):
            return
        rel = mod_name[len(self.plan.layers) + 1 :].split(".", 1)
        rel = rel[1] if len(rel) > 1 else ""
        for owner, attr in self.plan.divide_attrs:
            if rel == owner:
                setattr(mod, attr, getattr(mod, attr) // size)
        if rel in self.plan.colwise or rel in self.plan.rowwise:
            w = mod.weight
            if hasattr(mod, "nf"):  # Conv1D: (in, out)
                mod.nf = w.shape[1]
            if isinstance(mod, nn.Linear):
                mod.out_features, mod.in_features = w.shape

    def _install_all_reduce(self) -> None:
        if self.tp.size == 1:
            return
        import torch.distributed as tdist

        group = self.tp.group

        def reduce(_m: nn.Module, _inp, out: torch.Tensor) -> torch.Tensor:
            tdist.all_reduce(out, group=group)
            return out

        layers = self.model.get_submodule(self.plan.layers)
        for block in layers:
            for rel in self.plan.rowwise:
                block.get_submodule(rel).register_forward_hook(reduce)

    # ------------------------------------------------------------------ refill
    def chunks(self, layers_per_chunk: int) -> list[list[_Fill]]:
        """The fills grouped for gathering: everything at once (``layers_per_chunk`` 0), else the
        non-block parameters first and then ``layers_per_chunk`` decoder blocks per group."""
        if layers_per_chunk <= 0:
            return [self.fills]
        rest = [f for f in self.fills if f.chunk < 0]
        blocks = sorted({f.chunk for f in self.fills if f.chunk >= 0})
        out = [rest] if rest else []
        for i in range(0, len(blocks), layers_per_chunk):
            keep = set(blocks[i : i + layers_per_chunk])
            out.append([f for f in self.fills if f.chunk in keep])
        return out

    @torch.no_grad()
    def refill(
        self,
        gather: Gather,
        layers_per_chunk: int = 0,
        probe: Callable[[], None] | None = None,
    ) -> int:
        """Copy the training weights (LoRA merged, this rank's TP slice) into the copy.

        ``gather(params)`` must make the full values of ``params`` readable inside its block (ZeRO-3:
        ``deepspeed.zero.GatheredParameters``; otherwise a no-op). Returns the largest number of bytes
        of full training parameters held at once (the gathering's peak). ``probe()`` is called while
        each chunk is gathered (to read device memory at the peak).
        """
        peak = 0
        for chunk in self.chunks(layers_per_chunk):
            sources = list({id(p): p for f in chunk for p in f.sources}.values())
            with gather(sources):
                peak = max(peak, sum(_full_numel(p) * p.element_size() for p in sources))
                if probe is not None:
                    probe()
                for f in chunk:
                    if f.spec.rank0_only and self.tp.rank != 0:
                        f.target.zero_()
                    else:
                        f.target.copy_(shard(f.compute(), f.spec, self.tp.rank, self.tp.size))
        return peak

    def release(self) -> None:
        """Drop the copy's weight storage (shapes stay known; :meth:`allocate` before the next refill)."""
        for f in self.fills:
            f.target.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def allocate(self) -> None:
        for f in self.fills:
            if tuple(f.target.shape) != f.shape:
                f.target.data = torch.empty(f.shape, dtype=self.dtype, device=self.device)


def _full_numel(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


@contextlib.contextmanager
def no_gather(_params: list[nn.Parameter]) -> Iterator[None]:
    yield


__all__ = [
    "PLANS",
    "ArchPlan",
    "Gather",
    "InferenceCopy",
    "ShardSpec",
    "TPGroup",
    "UnsupportedModel",
    "local_shape",
    "merged_lora_weight",
    "no_gather",
    "plan_for",
    "shard",
    "shard_spec",
]
