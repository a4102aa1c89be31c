"""Distributed setup and ``deepspeed.initialize`` with the optimizer and schedule DeepSpeed-Chat uses.

One code path for CPU and GPU: gloo + DeepSpeed's CPU accelerator without CUDA, NCCL with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch

from dschat.utils import dist
from dschat.utils.errors import UserError

LOG = logging.getLogger("dschat")


def init_distributed(timeout_minutes: float | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on GPU); safe to call twice.

    A collective that waits longer than the timeout (default 30 minutes; ``DSCHAT_DIST_TIMEOUT`` in
    seconds, which ``train.py --dist-timeout`` sets) raises instead of hanging for ever, e.g. when a
    peer rank hangs. A peer that dies is noticed at once (its sockets close) and the launcher ends the job.
    """
    import datetime

    import deepspeed

    dist.ensure_single_process_env()
    if torch.cuda.is_available():
        if "LOCAL_RANK" in os.environ:  # set by the DeepSpeed launcher and torchrun; MPI ones: see below
            torch.cuda.set_device(dist.local_rank())
        backend = "nccl"
    else:
        backend = "gloo"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Several CPU ranks on one machine: split the cores, or their thread pools fight over them
        # (oversubscribed OpenMP threads spin and run many times slower).
        # torchrun sets LOCAL_WORLD_SIZE, the DeepSpeed launcher LOCAL_SIZE
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        if local > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(dist.threads_per_rank(local))
        if msg := dist.shared_cpu_warning(local):
            LOG.warning(msg)
    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get("DSCHAT_DIST_TIMEOUT", 1800)) / 60
    if not dist.is_initialized():
        if backend == "gloo":  # DeepSpeed's CPU backend JIT-builds its shared-memory op, one rank or many
            from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

            clear_stale_build_lock(ShareMemCommBuilder.NAME)
        # Under MPI-style launchers DeepSpeed finds the ranks itself and sets MASTER_PORT to this port
        # (its default, 29500, would ignore train.py's --master-port), and LOCAL_RANK only now.
        port = int(os.environ.get("MASTER_PORT") or 29500)
        deepspeed.init_distributed(
            dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes), distributed_port=port
        )
        if backend == "nccl":
            torch.cuda.set_device(dist.local_rank())
        if backend == "gloo":
            _unlink_shared_memory_names()


STALE_BUILD_LOCK_SECONDS = 600


def clear_stale_build_lock(op_name: str) -> None:
    """Remove the lock of a dead JIT build of a DeepSpeed C++ op, so that the next build runs.

    torch's extension builder creates ``<build dir>/lock``, keeps it open while it compiles and removes it
    when done; a build whose process was killed (the OOM killer, a harness's timeout) leaves it, and every
    later build of that op waits for it to go away, for ever and without a word: a run with ``--offload``
    hung at its optimizer (seen here after a build died for want of memory). A lock is dead when it is
    older than ten minutes (a build takes one to two on 2 CPU cores) and no process on this machine holds
    it open. The check and the removal hold an exclusive ``flock`` on the build directory, so ranks that
    start together cannot remove the fresh lock of the one that already began to build. Best effort: a
    cache directory that cannot be read or written is left to torch's own error.
    """
    import fcntl
    import time

    from torch.utils.cpp_extension import _get_build_directory

    with contextlib.suppress(OSError):
        build_dir = _get_build_directory(op_name, verbose=False)
        lock = os.path.join(build_dir, "lock")
        if not os.path.exists(lock):
            return
        guard = os.open(build_dir, os.O_RDONLY)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            age = time.time() - os.path.getmtime(lock)
            if age > STALE_BUILD_LOCK_SECONDS and not _held_open(lock):
                LOG.warning(
                    "removing %s, left %.0f min ago by a build of %s that never finished",
                    lock,
                    age / 60,
                    op_name,
                )
                os.unlink(lock)
        finally:
            os.close(guard)  # releases the flock


def _held_open(path: str) -> bool:
    """Whether a process on this machine has ``path`` open (Linux's /proc; elsewhere: no)."""
    import glob

    target = os.path.realpath(path)
    for fds in glob.glob("/proc/[0-9]*/fd"):
        with contextlib.suppress(OSError):  # processes come and go, others' fds may be unreadable
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    if os.readlink(os.path.join(fds, fd)) == target:
                        return True
    return False


def _unlink_shared_memory_names() -> None:
    """Give back DeepSpeed's shared-memory all-reduce buffers when the run ends, not at reboot.

    On CPU, when every rank is on one machine (the DeepSpeed launcher sets ``LOCAL_SIZE``, also for one
    rank), DeepSpeed maps one /dev/shm segment per rank, 66 MB each, and never unlinks it: every such run
    left its segments in RAM until reboot (20 GB after a day of test runs, measured, and the next C++ build
    died for want of memory). Each rank has mapped every peer's segment before its init returns, so after a
    barrier each rank unlinks its own name; the mappings stay valid and the memory is freed when the ranks
    exit. The name is DeepSpeed's: uid, ``MASTER_ADDR``, ``MASTER_PORT``, global rank.
    """
    if dist.world_size() > 1:
        dist.barrier()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.rank()
    )
    with contextlib.suppress(FileNotFoundError):  # not created: ranks on several machines, or torchrun
        os.unlink(os.path.join("/dev/shm", name))


def _onednn_bf16() -> bool:
    """oneDNN accepts bf16 here: in hardware, or emulated through fp32 on any AVX-512 CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def bf16_supported() -> bool:
    """bf16 runs on this device at all (on some CPUs only emulated, and then slower than fp32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return _onednn_bf16()


def bf16_native() -> bool:
    """bf16 matmuls run in hardware: a GPU with bf16 units (Ampere and later, not an emulating V100 or
    T4); on x86, AVX512-BF16 or AMX; elsewhere (Arm) oneDNN's own answer, which is yes only where the CPU
    has bf16 instructions.

    An AVX-512 CPU without either accepts bf16 but converts around every matmul: 3.6x below its fp32
    matmul peak and 2.7-3.1x slower training (2 cores, SmolLM2, measured 2026-11-28)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        # private probes of torch.cpu (torch >= 2.1); a torch without them is taken to lack the features
        def has(feature: str) -> bool:
            return bool(getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)())

        return _onednn_bf16() and (has("avx512_bf16") or has("amx_tile"))
    return _onednn_bf16()


def auto_dtype() -> str:
    """What ``--dtype auto`` trains in on this device: bf16 where it is computed in hardware, else fp32."""
    return "bf16" if bf16_native() else "fp32"


def resolve_dtype(dtype: str, flag: str = "--dtype") -> str:
    """``auto`` -> :func:`auto_dtype`; an explicit choice this device cannot run is an error."""
    if dtype == "auto":
        return auto_dtype()
    device = "GPU" if torch.cuda.is_available() else "CPU"
    if dtype == "bf16" and not bf16_supported():
        raise UserError(f"{flag} bf16: this {device} does not support bf16")
    if dtype == "bf16" and not bf16_native():
        lacks = "bf16 units" if device == "GPU" else "bf16 instructions"
        LOG.warning("%s bf16: this %s has no %s, so bf16 runs emulated and slower than fp32 (--dtype auto "
                    "picks %s here)", flag, device, lacks, auto_dtype())  # fmt: skip
    if dtype == "fp16" and device == "CPU":
        raise UserError(f"{flag} fp16: fp16 training needs a GPU (use bf16 or fp32 on CPU)")
    return dtype


@contextlib.contextmanager
def zero3_loading(ds_config: dict[str, Any]) -> Iterator[None]:
    """Make ``from_pretrained`` build ZeRO-3 partitioned parameters (only when stage == 3).

    transformers keeps a weak reference to the live ``HfDeepSpeedConfig``; while it exists,
    ``from_pretrained`` loads inside ``deepspeed.zero.Init`` and each rank keeps only its shard.
    It is removed on exit so that later ``from_config`` calls (e.g. the skeleton used when exporting
    a merged LoRA model) build ordinary, unpartitioned modules.
    """
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()


@contextlib.contextmanager
def gather_zero3(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Full values of the ZeRO-3 partitioned ``params`` on every rank inside the block (collective);
    other parameters are already whole."""
    z3 = [p for p in params if hasattr(p, "ds_id")]
    if not z3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(z3, modifier_rank=None):
        yield


def param_groups(model: torch.nn.Module, weight_decay: float, lora_lr: float | None, lr: float) -> list[dict]:
    """AdamW groups: no decay on biases and norm weights; LoRA matrices at their own learning rate.

    A norm is told by its shape (one dimension; under ZeRO-3 the shape before partitioning), not only by
    its name: GPT-2's ``ln_1``/``ln_f`` and Falcon's ``ln_attn`` have no "norm" in theirs."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        one_dim = len(getattr(p, "ds_shape", p.shape)) <= 1
        no_decay = one_dim or name.endswith(".bias") or "norm" in name.lower()
        is_lora = "lora_" in name
        groups.setdefault((no_decay, is_lora), []).append(p)
    out = []
    for (no_decay, is_lora), params in sorted(groups.items()):
        out.append(
            {
                "params": params,
                "weight_decay": 0.0 if no_decay else weight_decay,
                "lr": lora_lr if (is_lora and lora_lr is not None) else lr,
            }
        )
    return out


def make_optimizer(groups: list[dict], *, lr: float, betas: tuple[float, float], offload: bool):
    """DeepSpeedCPUAdam when optimizer states live in CPU memory (ZeRO-Offload needs it), else torch's
    fused AdamW, on CPU as on GPU: one kernel over every tensor (10x faster than the foreach loop for
    a 6M-parameter model on one CPU core, measured, and without DeepSpeed's JIT-built FusedAdam)."""
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        clear_stale_build_lock(CPUAdamBuilder.NAME)
        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def make_scheduler(optimizer, kind: str, warmup: int, total: int):
    from transformers import get_scheduler

    return get_scheduler(kind, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=max(total, 1))


def initialize_engine(
    model: torch.nn.Module, *, optimizer=None, lr_scheduler=None, ds_config: dict[str, Any]
):
    """``deepspeed.initialize`` and nothing else: every training run goes through it."""
    import deepspeed

    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        # Parameters created after zero.Init (LoRA matrices, a value head) are still full fp32 tensors,
        # while ZeRO-3 flattens all partitions into one buffer of the training dtype.
        target = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            "bf16" if ds_config["bf16"]["enabled"] else "fp16" if ds_config["fp16"]["enabled"] else "",
            torch.float32,
        )
        for p in model.parameters():
            if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config
    )
    return engine


class SkippedSteps:
    """The optimizer steps DeepSpeed skipped for one engine (``engine.skipped_steps``), watched after each
    ``engine.step()``.

    DeepSpeed skips a step whose gradients hold inf or NaN, and the learning-rate schedule with it (in
    fp32 without ZeRO it checks nothing and applies it: there the weights are checked instead). In fp16
    that is how the dynamic loss scale finds its level (DeepSpeed logs each one) and is left alone here. In
    bf16 and fp32 there is no loss scale to lower: a skip is a non-finite gradient and the batch taught
    nothing, yet DeepSpeed says nothing and the run goes on with finite losses (attention kernels that
    return NaN gradients for fully masked rows have done this). Each such skip is a warning naming the
    optimizer step, and ``limit`` in a row stop the run with one line: a run whose every step is skipped
    does not learn.
    """

    def __init__(self, engine, name: str, limit: int = 8) -> None:
        self.engine, self.name, self.limit = engine, name, limit
        self.in_a_row = 0
        # fp32 without ZeRO: DeepSpeed hands the step to the bare torch optimizer, which has no overflow
        # check, and an inf/NaN gradient is applied; the weights are then checked after each step
        optimizer = getattr(engine, "optimizer", None)
        self.unchecked = optimizer is not None and not hasattr(optimizer, "overflow")
        self.mark()

    @property
    def count(self) -> int:
        """The engine's skipped steps over the whole run (a resumed engine brings its count back)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def _steps(self) -> int:  # optimizer steps taken or skipped (DeepSpeed counts both)
        return int(getattr(self.engine, "global_steps", 0))

    def mark(self) -> None:
        """Before an optimizer step (``engine.step()`` at a boundary, or the micro-batches ending in one):
        the counters :meth:`check` compares with. Marked at each step, so that counters a checkpoint
        brought back since (``--resume``) are never taken for new skips."""
        self.seen, self.steps = self.count, self._steps()

    def step(self) -> bool:
        """``engine.step()`` between :meth:`mark` and :meth:`check`; whether DeepSpeed skipped it."""
        self.mark()
        self.engine.step()
        return self.check()

    def check(self) -> bool:
        """After ``engine.step()``: whether DeepSpeed skipped the optimizer step taken since :meth:`mark`
        (False where none was taken: a call between gradient-accumulation boundaries)."""
        steps, now = self._steps(), self.count
        skipped = steps != self.steps and now != self.seen
        if steps != self.steps:
            self.in_a_row = self.in_a_row + (now - self.seen) if skipped else 0
            if self.unchecked:
                self._check_weights(steps)
        self.mark()
        if not skipped or self.engine.fp16_enabled():
            return skipped
        LOG.warning("optimizer step %d: DeepSpeed skipped the %s's update (its gradients hold inf or NaN); "
                    "%d skipped so far", steps, self.name, now)  # fmt: skip
        if self.in_a_row >= self.limit:
            raise UserError(
                f"optimizer step {steps}: the {self.name}'s last {self.in_a_row} updates were all skipped "
                "(gradients with inf or NaN, and outside fp16 no loss scale to lower): it has stopped "
                "learning; lower --learning_rate, or look for inf/NaN in the model's outputs"
            )
        return skipped

    def _check_weights(self, steps: int) -> None:
        """Where DeepSpeed applies every step (:attr:`unchecked`): one line once a trained weight is no
        longer finite, which no later step can undo (one reduction over the trained weights per step)."""
        trained = [p for p in self.engine.module.parameters() if p.requires_grad]
        if trained and not bool(torch.stack([p.detach().isfinite().all() for p in trained]).all()):
            raise UserError(
                f"optimizer step {steps}: the {self.name}'s weights are no longer finite (an inf or NaN gradient "
                "was applied: in fp32 without ZeRO, DeepSpeed checks none); lower --learning_rate, or look for "
                "inf/NaN in the model's outputs"
            )
