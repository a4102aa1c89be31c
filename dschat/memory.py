"""Memory planning: estimated peak memory per device and per node for every ZeRO stage / offload /
gradient-checkpointing choice of a step, from a model *config* alone (no weights, no deepspeed).

    python train.py --estimate-memory --step 1 --actor-model facebook/opt-1.3b --deployment-type single_node

What is counted (bytes; ``P`` parameters, ``N`` devices in all, ``w`` bytes of the training dtype):

* Model states, with the formulas of DeepSpeed's own estimators for 16-bit training
  (``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` and
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, checked against them by
  ``tests/integration/test_memory_deepspeed.py``): ZeRO-1/2 ``2P + 18P/N`` per device (16-bit params,
  then 16-bit and fp32 grads, fp32 master weights and the two Adam moments, partitioned); ZeRO-3
  ``4 x largest_layer + 18P/N``; with optimizer offload (ZeRO-1/2) ``2P`` per device and
  ``P x max(4N, 16) x 1.5`` CPU bytes per node; ZeRO-3 with parameters offloaded too (dschat's
  ``--offload`` under ZeRO-3) ``4 x largest_layer`` per device and ``18P / nodes x 1.5`` CPU per node.
  ZeRO-0 keeps everything on the device: ``20P`` (the ZeRO-1/2 formula with nothing partitioned).
  ZeRO-1 keeps the whole gradient on every device: ``(w - w/N) P`` more than ZeRO-2 (``4P + 16P/N``
  in 16-bit). In fp32 there is no 16-bit gradient, but ZeRO-1/2 still clone a master copy:
  ``4P + 16P/N`` (ZeRO-2), ``16P/N`` (ZeRO-3), ``16P`` (ZeRO-0). Frozen parameters (a LoRA base, step 3's reference and reward
  models) cost ``wP`` (``wP/N`` under ZeRO-3; on the CPU when offloaded).
* Activations kept for the backward pass of one micro-batch ``b`` x ``s`` tokens, assuming SDPA
  attention (no ``s^2`` score matrix is stored) and no dropout masks, per decoder layer
  ``w b s (4h + 2 q + 2 kv + m f)``: two norm inputs and outputs, queries, keys and values, the
  attention output, and the MLP intermediates (``m`` = 4 for a gated SwiGLU MLP, 2 for a plain one).
  With gradient checkpointing only each layer's input (``w b s h``) is kept, plus one layer's
  activations while it is recomputed. The LM head adds ``b s V (w + 4 + 4)``: the logits, their fp32
  copy for the loss and its gradient (``b s V 8`` in fp32).
* DeepSpeed's gradient-reduction bucket per trained engine under ZeRO-1/2/3 (``reduce_bucket_size``,
  set to 5e7 elements: ``4 x 5e7`` bytes under ZeRO-1, ``w x 5e7`` under ZeRO-2/3).
* Step 3: the four models' states, plus the largest of generation (KV cache ``2 L b (p + a) kv w``),
  the experience pass (forward-only logits ``b (p + a) V (w + 8)``, ``w + 16`` for the actor's, whose
  entropy is taken too), the actor's training activations (plus an SFT batch's with the PTX term),
  the critic's, and under ZeRO-3 with the hybrid engine the actor gathered to refill its inference copy.
  With the frozen trunk shared (below ZeRO-3, the actor's bottom frozen), the
  experience pass also keeps ``w b (p + a) h`` per model that starts from it, the update one of them.
  ``--enable_ema`` adds ``(4 + w) P`` on the writing rank (CPU RAM).
* A fixed runtime overhead per process: the CUDA context and allocator slack on a GPU
  (:data:`GPU_RUNTIME_BYTES`, assumed), the Python + torch + transformers + DeepSpeed process on a CPU
  (:data:`CPU_RUNTIME_BYTES`, the measured peak RSS of a step-1 run of a model with almost no weights).

Checked against measured peak RSS on CPU in README ("Memory planning"). The GPU numbers follow the same
formulas but were not checked on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dschat.engine.ds_config import REDUCE_BUCKET_SIZE, frozen_stage
from dschat.models.shapes import ModelShape

GIB = 1024**3
GPU_RUNTIME_BYTES = 1 * GIB  # CUDA context, cuBLAS workspace, caching-allocator slack (assumed, not measured)
# interpreter + torch + transformers + deepspeed + data pipeline: the peak RSS of a step-1 run of
# builtin:micro-llama (0.14M parameters, so nearly nothing else), measured (README, bench/bench_memory.py)
CPU_RUNTIME_BYTES = int(0.55 * GIB)
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default headroom on CPU memory
FIT_FRACTION = 0.9  # a choice fits when its estimate is at most this share of the memory available


# ---------------------------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Choice:
    """One memory configuration of a step: ZeRO stage, CPU offload, gradient checkpointing."""

    zero_stage: int
    offload: bool
    gradient_checkpointing: bool

    def describe(self) -> str:
        what = "optimizer states and parameters" if self.zero_stage == 3 else "optimizer states"
        return (f"ZeRO-{self.zero_stage}, " + (f"{what} offloaded to CPU" if self.offload else "no offload")
                + ", gradient checkpointing " + ("on" if self.gradient_checkpointing else "off"))  # fmt: skip


# Fastest first: a higher stage costs communication, checkpointing ~1/3 more compute, offload the most.
CANDIDATES: tuple[Choice, ...] = (
    Choice(0, False, False),
    Choice(1, False, False),
    Choice(2, False, False),
    Choice(3, False, False),
    Choice(0, False, True),
    Choice(2, False, True),
    Choice(3, False, True),
    Choice(2, True, True),
    Choice(3, True, True),
)


def zero2_model_states(params: int, gpus_per_node: int, nodes: int, offload: bool) -> tuple[int, int]:
    """DeepSpeed's ZeRO-1/2 estimate for 16-bit training: ``(cpu bytes per node, gpu bytes per device)``."""
    total = gpus_per_node * nodes
    if offload:
        return int(params * max(4 * total, 16) * ADDITIONAL_BUFFER_FACTOR), 2 * params
    return int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 2 * params + int(18 * params / total)


def zero3_model_states(params: int, largest: int, gpus_per_node: int, nodes: int, offload_optimizer: bool,
                       offload_params: bool) -> tuple[int, int]:  # fmt: skip
    """DeepSpeed's ZeRO-3 estimate (with ``zero.Init``) for 16-bit training: ``(cpu per node, gpu per device)``."""
    total, largest_bytes = gpus_per_node * nodes, 4 * largest
    if offload_optimizer and offload_params:
        return int(params * 18 / nodes * ADDITIONAL_BUFFER_FACTOR), largest_bytes
    if offload_optimizer:
        return int(params * 16 / nodes * ADDITIONAL_BUFFER_FACTOR), largest_bytes + int(2 * params / total)
    return int(largest * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), largest_bytes + int(
        18 * params / total
    )


def trained_states(params: int, largest: int, choice: Choice, dtype_bytes: int, gpus_per_node: int,
                   nodes: int) -> tuple[int, int]:  # fmt: skip
    """``(cpu bytes per node, device bytes)`` of the parameters, gradients and Adam states of a trained
    model. 16-bit: DeepSpeed's formulas; fp32: the same terms without the master copy and 16-bit grads."""
    total = gpus_per_node * nodes
    stage, offload = choice.zero_stage, choice.offload
    # ZeRO-1 partitions the optimizer states but not the gradients: every device keeps the whole
    # gradient in the training dtype, (w - w / N) P bytes more than ZeRO-2 (DeepSpeed's own estimator
    # covers ZeRO-2 only; it partitions gradients only when partition_grads, i.e. stage 2)
    full_grads = dtype_bytes * params - int(dtype_bytes * params / total) if stage == 1 and not offload else 0
    if dtype_bytes == 2:
        if stage == 3:
            return zero3_model_states(params, largest, gpus_per_node, nodes, offload, offload)
        if stage in (1, 2):
            cpu, device = zero2_model_states(params, gpus_per_node, nodes, offload)
            return cpu, device + full_grads
        return int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 20 * params
    # fp32: 4 (params) + 4 (grads) + 8 (Adam moments) per parameter; under ZeRO-1/2 DeepSpeed also clones
    # its partition of the weights as the optimizer's master copy (4 per parameter, partitioned), in fp32 too
    load_cpu = int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR)
    if stage == 3:
        if offload:
            return int(params * 16 / nodes * ADDITIONAL_BUFFER_FACTOR), 4 * largest
        return int(largest * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR), 4 * largest + int(
            16 * params / total
        )
    if stage in (1, 2):
        if offload:
            return int(params * max(4 * total, 16) * ADDITIONAL_BUFFER_FACTOR), 4 * params
        return load_cpu, 4 * params + int(16 * params / total) + full_grads
    return load_cpu, 16 * params


def frozen_states(params: int, largest: int, zero_stage: int, offload: bool, dtype_bytes: int,
                  gpus_per_node: int, nodes: int) -> tuple[int, int]:  # fmt: skip
    """``(cpu bytes per node, device bytes)`` of a model that is only run forward (no grads, no optimizer)."""
    total = gpus_per_node * nodes
    if zero_stage == 3:
        if offload:
            return int(params * dtype_bytes / nodes * ADDITIONAL_BUFFER_FACTOR), dtype_bytes * largest
        return 0, dtype_bytes * largest + int(dtype_bytes * params / total)
    return 0, dtype_bytes * params


def gradient_bucket_bytes(choice: Choice, dtype_bytes: int) -> int:
    """DeepSpeed's gradient-reduction bucket of one trained engine (``reduce_bucket_size`` elements,
    :data:`dschat.engine.ds_config.REDUCE_BUCKET_SIZE`): kept for the run under ZeRO-3, allocated for
    each backward under ZeRO-1/2 (in fp32 under ZeRO-1, which stages the fp32 accumulator there)."""
    if choice.zero_stage == 0:
        return 0
    return REDUCE_BUCKET_SIZE * (4 if choice.zero_stage == 1 else dtype_bytes)


# ---------------------------------------------------------------------------------------------- activations
def layer_activation_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """Activations one decoder layer keeps for its backward pass, for a ``batch x seq`` micro-batch."""
    m = 4 if shape.gated_mlp else 2
    per_token = 4 * shape.hidden_size + 2 * shape.q_dim + 2 * shape.kv_dim + m * shape.intermediate_size
    return dtype_bytes * batch * seq * per_token


def logits_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """The LM head's logits in the training dtype, their fp32 copy for the loss, and its gradient."""
    return batch * seq * shape.vocab_size * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 4)


def activation_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int, checkpointing: bool,
                     head: str = "lm", trainable_layers: int = 0) -> int:  # fmt: skip
    """Peak activation memory of one training micro-batch (forward kept for backward, plus the head).
    Below ``trainable_layers`` nothing requires a gradient, so those layers keep nothing for backward."""
    layer, kept = layer_activation_bytes(shape, batch, seq, dtype_bytes), trainable_layers or shape.num_layers
    if checkpointing:  # each layer's input kept; one layer's activations live while it is recomputed
        body = kept * dtype_bytes * batch * seq * shape.hidden_size + layer
    else:
        body = kept * layer
    final_norm = 2 * dtype_bytes * batch * seq * shape.hidden_size
    if head == "lm":
        head_bytes = logits_bytes(shape, batch, seq, dtype_bytes)
    else:  # the fp32 scores; in 16 bits the head keeps the fp32 copy of its input (Fp32ScoreHead)
        head_bytes = 4 * batch * seq * (1 + (shape.hidden_size if dtype_bytes < 4 else 0))
    return body + final_norm + head_bytes


def kv_cache_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``seq`` tokens (generation)."""
    return 2 * shape.num_layers * batch * seq * shape.kv_dim * dtype_bytes


def forward_only_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int, head: str = "lm",
                       entropy: bool = False) -> int:  # fmt: skip
    """Peak of a no-grad forward pass: one layer's activations, and the logits with their fp32 log-probs
    (8 bytes per logit: the fp32 copy and the log-softmax). ``entropy`` (the actor's experience pass): 16,
    the log-softmax and the entropy's clamped copy, its exp and their product (measured: 16.08 on CPU)."""
    per_logit = dtype_bytes + (16 if entropy else 8)
    head_bytes = batch * seq * shape.vocab_size * per_logit if head == "lm" else 4 * batch * seq
    return layer_activation_bytes(shape, batch, seq, dtype_bytes) + head_bytes


# ---------------------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class Hardware:
    """Where a step runs: ``gpus_per_node`` processes on each of ``nodes`` nodes, on GPUs or CPU cores.

    ``device_bytes``: memory of one GPU (None: unknown); on CPU, the node's RAM is shared by its processes.
    """

    gpus_per_node: int
    nodes: int = 1
    on_gpu: bool = True
    device_bytes: int | None = None
    cpu_node_bytes: int | None = None

    @property
    def per_process_budget(self) -> int | None:
        if self.on_gpu:
            return self.device_bytes
        return self.cpu_node_bytes // self.gpus_per_node if self.cpu_node_bytes else None


@dataclass
class Estimate:
    """Peak bytes of one choice: per device (a GPU, or one CPU process) and CPU RAM per node."""

    choice: Choice
    device: int
    cpu_node: int
    parts: dict[str, int] = field(default_factory=dict)  # device bytes by cause

    def fits(self, hw: Hardware) -> bool | None:
        budget = hw.per_process_budget
        if budget is None:
            return None
        ok = self.device <= FIT_FRACTION * budget
        if hw.on_gpu and hw.cpu_node_bytes:
            ok = ok and self.cpu_node <= FIT_FRACTION * hw.cpu_node_bytes
        return ok


@dataclass(frozen=True)
class TrainWorkload:
    """Step 1 (``head="lm"``), step 2's reward model (``head="score"``, ``pairs``) or step 2 as DPO
    (``head="lm"``, ``pairs``, and ``reference`` when the reference is another model)."""

    shape: ModelShape
    batch: int  # per-device micro-batch of sequences (step 2: pairs)
    seq: int  # longest sequence (--max_seq_len)
    dtype_bytes: int
    head: str = "lm"
    lora_dim: int = 0
    only_lora: bool = False
    trainable_layers: int = 0  # --trainable_layers: only the top K decoder layers train (0 = all)
    pairs: bool = False  # chosen and rejected in one batch of 2b sequences (step 2)
    # DPO's --ref_model_name_or_path: before training, a plain frozen copy on every rank scores the pairs
    # (forward only) beside the policy's states, and is freed when training starts.
    reference: ModelShape | None = None


def _split_params(
    shape: ModelShape, head: str, lora_dim: int, only_lora: bool, trainable_layers: int = 0
) -> tuple[int, int]:
    """(trainable, frozen) parameter counts. With ``--trainable_layers`` K only the top K decoder layers,
    the final norm and a scalar head train (:func:`dschat.models.layers.freeze_below`), and LoRA goes
    into those K layers alone."""
    base, k = shape.parameters(head), trainable_layers or shape.num_layers
    lora = shape.lora_params(lora_dim) * k // shape.num_layers
    head_params = shape.score_params if head == "score" else 0
    if only_lora and lora_dim:  # the base is frozen; a new scalar head still trains
        return lora + head_params, base - head_params
    if trainable_layers:
        norm = shape.hidden_size * (2 if shape.norm_bias else 1) if shape.final_norm else 0
        top = k * shape.layer_params() + norm + head_params
        return top + lora, base - top
    return base + lora, 0


def _model(shape: ModelShape, head: str, lora_dim: int, only_lora: bool, choice: Choice, dtype_bytes: int,
           hw: Hardware, trainable_layers: int = 0) -> tuple[int, int]:  # fmt: skip
    """(cpu per node, device) states of a trained model, a frozen LoRA base or frozen lower layers included."""
    trainable, frozen = _split_params(shape, head, lora_dim, only_lora, trainable_layers)
    largest = shape.largest_layer_params(head)
    # With a frozen base the ZeRO-3 gather buffer of the largest layer is counted with the frozen part.
    cpu, dev = trained_states(
        trainable, 0 if frozen else largest, choice, dtype_bytes, hw.gpus_per_node, hw.nodes
    )
    if frozen:
        fcpu, fdev = frozen_states(frozen, largest, choice.zero_stage, choice.offload, dtype_bytes,
                                   hw.gpus_per_node, hw.nodes)  # fmt: skip
        cpu, dev = cpu + fcpu, dev + fdev
    return cpu, dev


def _finish(choice: Choice, parts: dict[str, int], cpu_node: int, hw: Hardware) -> Estimate:
    parts = dict(parts)
    parts["runtime"] = GPU_RUNTIME_BYTES if hw.on_gpu else CPU_RUNTIME_BYTES
    device = sum(parts.values())
    if not hw.on_gpu:  # everything is in RAM already: the node holds every process and the CPU states
        cpu_node = device * hw.gpus_per_node + cpu_node if choice.offload else device * hw.gpus_per_node
    return Estimate(choice, device, cpu_node, parts)


def estimate_train(work: TrainWorkload, choice: Choice, hw: Hardware) -> Estimate:
    """Peak memory of step 1 or step 2 under ``choice``: the policy's states plus the larger of its
    training activations and, for DPO with a separate reference, the reference pass before training."""
    cpu, states = _model(work.shape, work.head, work.lora_dim, work.only_lora, choice, work.dtype_bytes, hw,
                         work.trainable_layers)  # fmt: skip
    batch = work.batch * (2 if work.pairs else 1)
    acts = activation_bytes(work.shape, batch, work.seq, work.dtype_bytes, choice.gradient_checkpointing,
                            work.head, work.trainable_layers)  # fmt: skip
    parts = {"model states": states, "activations": acts}
    if work.reference is not None:
        ref = work.reference.parameters("lm") * work.dtype_bytes + forward_only_bytes(
            work.reference, batch, work.seq, work.dtype_bytes
        )
        if ref > acts:
            parts = {"model states": states, "reference pass": ref}
    if bucket := gradient_bucket_bytes(choice, work.dtype_bytes):
        parts["gradient bucket"] = bucket
    return _finish(choice, parts, cpu, hw)


@dataclass(frozen=True)
class RLHFWorkload:
    """Step 3: actor (+ frozen reference) from step 1, critic (+ frozen reward model) from step 2; the
    parts that options add or remove come from :class:`dschat.config.Step3Models`."""

    actor: ModelShape
    critic: ModelShape
    generation_batch: int  # prompts per device per round
    training_batch: int  # PPO micro-batch per device
    prompt_len: int
    answer_len: int
    dtype_bytes: int
    actor_lora_dim: int = 0
    critic_lora_dim: int = 0
    only_lora: bool = False
    actor_trainable_layers: int = 0  # --actor_trainable_layers (0 = every layer)
    critic_trainable_layers: int = 0  # --critic_trainable_layers
    reference: bool = True  # False with --share_reference_with_actor
    reward_model: bool = True  # False with --reward_fn ... --reward_fn_mode replace
    # --offload_reference_model / --offload_reward_model (with ZeRO-3): True or False where the command
    # line sets them, None where it does not (the plan's offload choice adds them then)
    offload_reference: bool | None = None
    offload_reward: bool | None = None
    critic_trained: bool = True  # False for the critic-free estimators (the critic shape is then unused)
    judge: ModelShape | None = None  # --judge_reward_model: frozen, like the reward model
    reward: ModelShape | None = None  # --reward_model_name_or_path: its own shape (default: the critic's)
    samples_per_prompt: int = 1  # --n_samples_per_prompt: generation_batch x this sequences per round
    inference_copy: bool = False  # the hybrid engine's copy of the actor in the training dtype
    inference_tp_size: int = 1  # the copy's matrices are split over this many ranks
    share_frozen_trunk: bool = False  # --share_frozen_trunk: hidden states kept at the actor's frozen depth
    # a round is one update below ZeRO-3 (config.one_update_per_round at stage 0): the experience pass
    # keeps the actor's training graph through the other models' passes
    one_update_per_round: bool = False
    critic_one_update_per_round: bool = False  # the same for the critic's graph
    ptx_seq_len: int = 0  # --unsupervised_dataset_name: SFT batches of --max_seq_len tokens (0: no PTX term)
    # --tp_gather_partition_size: decoder layers per gather refilling the copy (0: all)
    gather_layers: int = 0
    # --enable_ema: an fp32 average of the actor, and its 16-bit gather, on the writing rank
    ema: bool = False
    # the hybrid engine's StaticCache, kept between rounds on GPUs (not with --release_inference_cache)
    kept_kv_cache: bool = False


def rlhf_phases(work: RLHFWorkload, choice: Choice) -> dict[str, int]:
    """Step 3's passing phases (bytes beyond the models' states), of which the largest is the peak: the
    KV cache, the experience passes (the actor's with its entropy), the actor's update (with the PTX
    term's SFT batch, whose graph is built while the PPO graph is alive), the critic's update, and, with
    the hybrid engine under ZeRO-3, the actor gathered to refill its inference copy."""
    w, s = work.dtype_bytes, work.prompt_len + work.answer_len
    gc, rows = choice.gradient_checkpointing, work.generation_batch * work.samples_per_prompt
    phases = {
        "generation (KV cache)": kv_cache_bytes(work.actor, rows, s, w),
        "experience (forward passes)": forward_only_bytes(work.actor, rows, s, w, entropy=True),
        "actor training": activation_bytes(
            work.actor, work.training_batch, s, w, gc, "lm", work.actor_trainable_layers
        ),
    }
    if work.ptx_seq_len:
        phases["actor training"] += activation_bytes(work.actor, work.training_batch, work.ptx_seq_len, w, gc,
                                                     "lm", work.actor_trainable_layers)  # fmt: skip
    fused = work.one_update_per_round and choice.zero_stage < 3
    if work.share_frozen_trunk and work.actor_trainable_layers and choice.zero_stage < 3:
        # The experience pass keeps the hidden states (rows, p + a, h) where each model starts from the
        # actor's frozen bottom (at most one depth per model: the reference, the reward models, the
        # actor's update unless that is the experience pass itself), and the update holds the actor's
        # own while it trains.
        one = rows * s * work.actor.hidden_size * w
        kept = (not fused) + work.reference + work.reward_model + (work.judge is not None)
        phases["experience (forward passes)"] += kept * one
        phases["actor training"] += 0 if fused else one
    if fused:  # the update's graph is built in the experience pass and held through the others' forwards
        phases["experience (forward passes)"] += phases["actor training"]
    if work.critic_trained:
        phases["critic training"] = activation_bytes(work.critic, work.training_batch, s, w, gc, "score",
                                                     work.critic_trainable_layers)  # fmt: skip
        if work.critic_one_update_per_round and choice.zero_stage < 3:  # the critic's graph, likewise
            phases["experience (forward passes)"] += phases["critic training"]
    if work.inference_copy and choice.zero_stage == 3:
        # the refill gathers the partitioned actor whole, or --tp_gather_partition_size layers at a time
        # (and the embedding or head alone), beside the copy it fills
        a = work.actor
        chunk = (max(work.gather_layers * a.layer_params(), a.largest_layer_params("lm")) if work.gather_layers
                 else a.parameters("lm"))  # fmt: skip
        phases["hybrid switch (actor gathered)"] = w * min(chunk, a.parameters("lm"))
    return phases


def estimate_rlhf(work: RLHFWorkload, choice: Choice, hw: Hardware) -> Estimate:
    """Peak memory of step 3 under ``choice`` (same stage for actor and critic; offload also moves the
    ZeRO-3 reference and reward models to CPU, as --offload_reference_model / --offload_reward_model,
    unless the command line says otherwise)."""
    w = work.dtype_bytes
    stage_of_frozen = frozen_stage(choice.zero_stage)
    parts: dict[str, int] = {}
    cpu = 0
    c, parts["actor states"] = _model(work.actor, "lm", work.actor_lora_dim, work.only_lora, choice, w, hw,
                                      work.actor_trainable_layers)  # fmt: skip
    cpu += c
    trained = 1
    if work.critic_trained:
        c, parts["critic states"] = _model(work.critic, "score", work.critic_lora_dim, work.only_lora, choice, w,
                                           hw, work.critic_trainable_layers)  # fmt: skip
        cpu += c
        trained += 1
    if bucket := gradient_bucket_bytes(choice, w):
        parts["gradient buckets"] = trained * bucket
    for present, name, shape, head, off in (
        (work.reference, "reference", work.actor, "lm", work.offload_reference),
        (work.reward_model, "reward model", work.reward or work.critic, "score", work.offload_reward),
        (work.judge is not None, "judge", work.judge or work.critic, "score", work.offload_reward),
    ):
        if present:
            c, parts[name] = frozen_states(shape.parameters(head), shape.largest_layer_params(head), stage_of_frozen,
                                           choice.offload if off is None else off, w, hw.gpus_per_node, hw.nodes)  # fmt: skip
            cpu += c
    if work.inference_copy:  # whole (1/tp of each matrix), kept between rounds
        parts["inference copy"] = w * work.actor.parameters("lm") // max(work.inference_tp_size, 1)
    if work.ema:  # fp32 average plus the gathered 16-bit weights each update: the writing rank's CPU RAM
        ema = (4 + w) * work.actor.parameters("lm")
        if hw.on_gpu:
            cpu += ema
        else:
            parts["EMA (writing rank)"] = ema
    phases = rlhf_phases(work, choice)
    if work.kept_kv_cache and hw.on_gpu:  # the generation cache stays through training: a standing part
        parts["KV cache (kept between rounds)"] = phases.pop("generation (KV cache)")
    peak = max(phases, key=lambda k: phases[k])
    parts[f"activations: {peak}"] = phases[peak]
    return _finish(choice, parts, cpu, hw)


def plan(
    estimates: list[Estimate], hw: Hardware, fixed: dict[str, Any] | None = None
) -> tuple[Estimate | None, str]:
    """The first estimate (``estimates`` are in order of preference) that agrees with the ``fixed``
    choice fields the user set and fits ``hw``, and a one-line reason."""
    fixed = fixed or {}
    allowed = [e for e in estimates if all(getattr(e.choice, k) == v for k, v in fixed.items())]
    if not allowed:
        return None, "no configuration matches the flags given"
    if hw.per_process_budget is None:
        return allowed[0], "memory of the devices unknown: the fastest configuration"
    budget = hw.per_process_budget
    what = "GPU" if hw.on_gpu else f"process (RAM / {hw.gpus_per_node})"
    for e in allowed:
        if e.fits(hw):
            return e, (f"the fastest that fits: {gib(e.device)} of {gib(budget)} GiB per {what} "
                       f"(limit {FIT_FRACTION:.0%})")  # fmt: skip
    # the closest: the smallest overshoot of either limit (a choice that fits the GPU but needs more CPU
    # RAM than the node has is no better than one that overshoots the GPU)
    cpu = hw.cpu_node_bytes if hw.on_gpu else None

    def overshoot(e: Estimate) -> float:
        return max(e.device / budget, e.cpu_node / cpu if cpu else 0.0)

    best = min(allowed, key=overshoot)
    if best.device <= FIT_FRACTION * budget and cpu:  # the device fits: the node's RAM is what is short
        return best, (f"nothing fits: the closest needs {gib(best.cpu_node)} GiB of CPU RAM per node, of "
                      f"{gib(cpu)} GiB (limit {FIT_FRACTION:.0%}), and {gib(best.device)} GiB per {what}")  # fmt: skip
    return best, (f"nothing fits {gib(budget)} GiB per {what} (limit {FIT_FRACTION:.0%}); the closest needs "
                  f"{gib(best.device)} GiB")  # fmt: skip


def gib(n: float) -> str:
    """Bytes as GiB with 2 significant decimals (``1.25``)."""
    return f"{n / GIB:.2f}" if n < 100 * GIB else f"{n / GIB:.0f}"


def candidates(on_gpu: bool) -> list[Choice]:
    """Choices worth trying: offload moves memory from GPU to CPU, which is no help when the device is
    the CPU."""
    return [c for c in CANDIDATES if on_gpu or not c.offload]


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def human_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
