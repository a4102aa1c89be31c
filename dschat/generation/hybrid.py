"""The hybrid engine: fast generation for PPO from an actor trained under any ZeRO stage.

    generator = HybridGenerator(actor_engine, tokenizer, sampling, zero3=True, gather=gather_zero3)
    with generator.generation_mode() as gen:      # gather -> inference copy (LoRA merged)
        sequences = gen.generate(input_ids, attention_mask)   # (B, P) -> (B, P + n)
    # back to training: the engine's weights, optimizer state and ZeRO partitions are untouched

Plain ``generate`` on a ZeRO-3 module gathers every layer's weights again for every new token. Here
the partitioned weights are gathered once per round (``gather``: the engine's
:func:`dschat.engine.core.gather_zero3`, passed in so that this package needs no DeepSpeed; all at
once or ``gather_layers`` decoder blocks at a time) into an *inference copy*: a plain transformers
model of the same config, built once without ZeRO-3 hooks, in the training dtype, with LoRA merged
(``W + scaling * B @ A`` computed into the copy; the training module is only read). Each rank then
generates alone with a KV cache (transformers ``StaticCache``), so no rank waits for another.

Options (the step-3 flags): ``tp_size`` (``--inference_tp_size``): K ranks hold 1/K of every attention
and MLP matrix and generate their combined prompts together; ``gather_layers``
(``--tp_gather_partition_size``); ``release_cache`` (``--release_inference_cache``): free the copy
and the KV cache after each round; ``unpin`` (``--unpin_actor_parameters``): no copy at all, generate
on the training module itself (ZeRO-3 gathers each layer per token: least memory, slowest).
Architectures outside :data:`dschat.generation.inference_copy.PLANS` fall back to
:class:`~dschat.generation.plain.PlainGenerator` with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import torch

from dschat.generation.inference_copy import (
    Gather,
    InferenceCopy,
    TPGroup,
    UnsupportedModel,
    no_gather,
    plan_for,
)
from dschat.generation.kv_decode import decode, position_ids_from_mask
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import stop_ids_for, through_first_stop
from dschat.models.attention import decode_cache
from dschat.utils import dist
from dschat.utils.errors import UserError

LOG = logging.getLogger("dschat")


def tp_groups(tp_size: int) -> TPGroup:
    """Split the world into consecutive groups of ``tp_size`` ranks (collective: every rank creates
    every group); this rank's place in its own."""
    world, rank = dist.world_size(), dist.rank()
    if tp_size == 1:
        return TPGroup()
    if world % tp_size:
        raise UserError(f"--inference_tp_size {tp_size} must divide the number of ranks ({world})")
    import torch.distributed as tdist

    mine = TPGroup()
    for first in range(0, world, tp_size):
        ranks = list(range(first, first + tp_size))
        group = tdist.new_group(ranks)
        if rank in ranks:
            mine = TPGroup(rank=rank - first, size=tp_size, group=group, leader=first)
    return mine


class HybridGenerator:
    """Same interface as :class:`PlainGenerator`: ``with g.generation_mode() as gen: gen.generate(...)``.

    ``gather`` makes ZeRO-3 partitioned parameters whole inside its block (:func:`dschat.engine.core.gather_zero3`);
    required with ``zero3``, where copying without it would read empty partitions.
    ``dtype`` is the inference copy's dtype (default: the training parameters' dtype).
    ``static_cache``: a transformers ``StaticCache`` kept between rounds (default: on GPUs only);
    otherwise a dynamic cache per call.
    ``measure_logprobs``: on the first ``generate`` call, and again on the first after the engine's first
    optimizer step, score the generated tokens with the training forward too and record the largest
    |log-prob difference| over both (reported by :meth:`stats`). The second look is the one that can see a
    wrong LoRA merge: a fresh adapter's B is zero, so at the first call the merge adds nothing.
    """

    def __init__(
        self,
        engine,
        tokenizer,
        sampling: SamplingConfig,
        *,
        zero3: bool,
        gather: Gather | None = None,
        tp_size: int = 1,
        gather_layers: int = 0,
        release_cache: bool = False,
        unpin: bool = False,
        dtype: torch.dtype | None = None,
        measure_logprobs: bool = True,
        fast_attention: bool = True,
        static_cache: bool | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.sampling, self.zero3 = engine, tokenizer, sampling, zero3
        if zero3 and gather is None:
            raise ValueError("HybridGenerator(zero3=True) needs gather= (dschat.engine.core.gather_zero3)")
        # a row ends at any of these (the end of turn, every EOS)
        self.stop_ids = stop_ids_for(tokenizer, stop_ids, engine)
        self.gather, self.gather_layers = gather or no_gather, gather_layers
        self.release_cache, self.unpin = release_cache, unpin
        # StaticCache: allocated once and kept between rounds, compile-friendly. On CPU a dynamic cache
        # decodes as fast (measured) and avoids StaticCache's first-use import of torch._dynamo (~2 s).
        self.static_cache = engine.device.type == "cuda" if static_cache is None else static_cache
        self.fallback: PlainGenerator | None = None
        self.fallback_reason: str | None = None
        self.copy: InferenceCopy | None = None
        self._model: torch.nn.Module | None = None
        self._caches: dict[int, tuple[object, int]] = {}  # batch -> (cache, length)
        self.measure_logprobs = measure_logprobs
        self._measured_at: list[int] = []  # the engine's optimizer step at each measurement
        self._active = False
        self.logprob_diff: dict[str, float] = {}
        self.switches, self.switch_seconds, self.first_switch_seconds = 0, 0.0, 0.0
        self.gather_peak_bytes, self.device_peak_bytes = 0, 0
        if unpin and tp_size > 1:
            raise UserError("--inference_tp_size > 1 needs an inference copy: drop --unpin_actor_parameters")
        module = engine.module
        try:
            plan_for(module.get_base_model() if hasattr(module, "get_base_model") else module, tp_size)
        except UnsupportedModel as exc:
            self._fall_back(str(exc))
            return
        self.tp = tp_groups(tp_size)
        if unpin:
            return
        self.dtype = dtype or next(module.parameters()).dtype
        try:
            self.copy = InferenceCopy(module, dtype=self.dtype, device=engine.device, tp=self.tp,
                                      fast_attention=fast_attention)  # fmt: skip
        except UnsupportedModel as exc:
            self._fall_back(str(exc))
        except ValueError as exc:  # a head count or width that K does not divide
            raise UserError(f"--inference_tp_size {tp_size}: {exc}") from None

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.fallback = PlainGenerator(self.engine, self.tokenizer, self.sampling, self.zero3, self.stop_ids)
        if dist.is_main():
            LOG.warning(
                "hybrid engine: %s; generating on the training module (the plain generator) instead", reason
            )

    # ------------------------------------------------------------------ switching
    @contextlib.contextmanager
    def generation_mode(self) -> Iterator[HybridGenerator | PlainGenerator]:
        """Training -> generation -> training. Collective under ZeRO-3 (the weights are gathered)."""
        if self.fallback is not None:
            with self.fallback.generation_mode() as gen:
                yield gen
            return
        module = self.engine.module
        was_training = module.training
        t = time.perf_counter()
        if self.copy is None:  # unpinned: the training module itself, without dropout
            module.eval()
            self._model = module
        else:
            self.copy.allocate()
            peak = self.copy.refill(self.gather, self.gather_layers, probe=self._probe_device_memory)
            self.gather_peak_bytes = max(self.gather_peak_bytes, peak)
            self._model = self.copy.model
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # the copies are asynchronous on GPUs
        seconds = time.perf_counter() - t
        self.first_switch_seconds = self.first_switch_seconds or seconds
        self.switches += 1
        self.switch_seconds += seconds
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            self._model = None
            if self.copy is None and was_training:
                module.train()
            if self.release_cache:
                self._caches.clear()
                if self.copy is not None:
                    self.copy.release()

    def _probe_device_memory(self) -> None:
        """Called while a chunk is gathered: the device memory in use then (not the process-wide peak
        counter, which other reports own and must not be reset here)."""
        if self.engine.device.type == "cuda":
            self.device_peak_bytes = max(
                self.device_peak_bytes, torch.cuda.memory_allocated(self.engine.device)
            )

    # ------------------------------------------------------------------ generation
    def _cache(self, model: torch.nn.Module, batch: int, length: int):
        """The KV cache of one generate call: a StaticCache for ``batch`` rows of at least ``length``
        tokens, kept between rounds (the last one made only); or (``static_cache`` off) None for a dynamic cache, or an fp32
        dynamic cache for a bf16/fp16 copy on CPU (the attention runs in fp32 there)."""
        if not self.static_cache:
            return decode_cache(model)
        from transformers import StaticCache

        cache, size = self._caches.get(batch, (None, 0))
        if cache is None or size < length:
            # one cache at a time: one per batch size seen (the rollouts', an evaluation's last partial
            # batch) stayed in device memory for the whole run, beyond what the memory plan counts
            self._caches.clear()
            size = -(-length // 16) * 16
            cache = StaticCache(config=model.config, max_cache_len=size)
            self._caches[batch] = (cache, size)
        else:
            cache.reset()
        return cache

    def _tp_gather_prompts(
        self, ids: torch.Tensor, mask: torch.Tensor, greedy_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list, torch.Tensor | None]:
        """All-gather the group's (B_r, P_r) prompts into one left-padded (sum B, max P) batch, and the
        rows' greedy flags (B_r,) where given (every rank gives them or none does)."""
        import torch.distributed as tdist

        g, k = self.tp.group, self.tp.size
        size = torch.tensor([ids.shape[0], ids.shape[1]], device=ids.device)
        sizes = [torch.zeros_like(size) for _ in range(k)]
        tdist.all_gather(sizes, size, group=g)
        sizes = [tuple(int(x) for x in s) for s in sizes]
        bmax, pmax = max(s[0] for s in sizes), max(s[1] for s in sizes)
        pad = self.tokenizer.pad_token_id

        def padded(x: torch.Tensor, value: int) -> torch.Tensor:
            out = x.new_full((bmax, pmax), value)
            out[: x.shape[0], pmax - x.shape[1] :] = x
            return out

        parts_ids = [torch.empty(bmax, pmax, dtype=ids.dtype, device=ids.device) for _ in range(k)]
        parts_mask = [torch.empty(bmax, pmax, dtype=mask.dtype, device=ids.device) for _ in range(k)]
        tdist.all_gather(parts_ids, padded(ids, pad), group=g)
        tdist.all_gather(parts_mask, padded(mask, 0), group=g)
        all_ids = torch.cat([p[: s[0]] for p, s in zip(parts_ids, sizes)])
        all_mask = torch.cat([p[: s[0]] for p, s in zip(parts_mask, sizes)])
        all_greedy = None
        if greedy_rows is not None:
            flags = ids.new_zeros(bmax)
            flags[: ids.shape[0]] = greedy_rows.to(ids.device).long()
            parts = [torch.empty_like(flags) for _ in range(k)]
            tdist.all_gather(parts, flags, group=g)
            all_greedy = torch.cat([p[: s[0]] for p, s in zip(parts, sizes)]).bool()
        return all_ids, all_mask, sizes, all_greedy

    def _tp_generator(self, device: torch.device) -> torch.Generator:
        """One sampling RNG shared by the group: the leader draws a seed from its global RNG."""
        import torch.distributed as tdist

        seed = (
            torch.randint(0, 2**62, (1,), device=device)
            if self.tp.rank == 0
            else torch.zeros(1, dtype=torch.long, device=device)
        )
        tdist.broadcast(seed, src=self.tp.leader, group=self.tp.group)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
        return gen

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingConfig | None = None,
        greedy_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, P) left-padded prompts -> (B, P + n) sequences (rows padded after their EOS);
        ``greedy_rows`` (B,) bool: rows decoded greedily, the rest by ``sampling``."""
        if not self._active or self._model is None:
            raise RuntimeError("HybridGenerator.generate() is only valid inside generation_mode()")
        s = sampling or self.sampling
        tok = self.tokenizer
        ids, mask, sizes = input_ids, attention_mask, None
        generator = None
        if self.tp.size > 1:
            ids, mask, sizes, greedy_rows = self._tp_gather_prompts(input_ids, attention_mask, greedy_rows)
            if s.do_sample:
                generator = self._tp_generator(ids.device)
        # ranks step together only when each forward is collective (the unpinned ZeRO-3 module)
        lockstep = True if (self.copy is None and self.zero3 and dist.world_size() > 1) else None
        measure = self._wants_measure()
        out = decode(
            self._model, ids, mask, s, eos_token_id=list(self.stop_ids), pad_token_id=tok.pad_token_id,
            cache=self._cache(self._model, ids.shape[0], ids.shape[1] + s.max_new_tokens),
            generator=generator, lockstep=lockstep, return_logprobs=measure, greedy_rows=greedy_rows,
        )  # fmt: skip
        seq, logprobs = out.sequences, out.logprobs
        if sizes is not None:  # hand this rank its own rows, without the group's extra left padding
            first = sum(b for b, _ in sizes[: self.tp.rank])
            b, p = sizes[self.tp.rank]
            cut = ids.shape[1] - p
            seq = seq[first : first + b, cut:]
            logprobs = logprobs[first : first + b] if logprobs is not None else None
        if measure:
            self._measure(seq, attention_mask, logprobs, input_ids.shape[1])
        return seq

    def _wants_measure(self) -> bool:
        """Measure at the first call, and at the first after the weights have taken an optimizer step (the
        same answer on every rank: the step count is)."""
        if not self.measure_logprobs:
            return False
        step = int(getattr(self.engine, "global_steps", 0))
        return not self._measured_at or (len(self._measured_at) == 1 and step > self._measured_at[0])

    def _measure(
        self, seq: torch.Tensor, prompt_mask: torch.Tensor, gen_logprobs: torch.Tensor, p: int
    ) -> None:
        """Max and mean |log pi_generation - log pi_training| over the generated tokens (through the stop).

        The training side is the engine's own forward (eval mode, the training dtype), as PPO uses it.
        Collective under ZeRO-3: every rank measures on its first ``generate`` call.
        """
        resp = seq[:, p:]
        valid = through_first_stop(resp, self.stop_ids)
        mask = torch.cat([prompt_mask.long(), valid.long()], dim=1)
        was_training = self.engine.module.training
        self.engine.eval()
        try:
            logits = self.engine(
                input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask)
            ).logits
        finally:
            if was_training:
                self.engine.train()
        train_lp = (
            torch.log_softmax(logits[:, p - 1 : -1].float(), dim=-1).gather(2, resp[..., None]).squeeze(2)
        )
        diff = (train_lp - gen_logprobs[:, : resp.shape[1]]).abs()[valid]
        n = float(diff.numel())
        mx = float(diff.max()) if n else 0.0
        total, count = dist.all_reduce_sum([float(diff.sum()), n])
        mx, mean = _all_max(mx), total / max(count, 1.0)
        step = int(getattr(self.engine, "global_steps", 0))
        self._measured_at.append(step)
        if dist.is_main():
            LOG.info("hybrid engine: generation vs training log-probs of %d tokens at optimizer step %d: "
                     "max |diff| %.2e, mean %.2e", int(count), step, mx, mean)  # fmt: skip
        before = self.logprob_diff
        self.logprob_diff = {  # the worse of the measurements
            "generation_logprob_max_diff": max(mx, before.get("generation_logprob_max_diff", 0.0)),
            "generation_logprob_mean_diff": max(mean, before.get("generation_logprob_mean_diff", 0.0)),
            "generation_logprob_tokens": count + before.get("generation_logprob_tokens", 0.0),
            "generation_logprob_measured_steps": len(self._measured_at),
        }

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, float | int | str | bool | None]:
        """Summary entries: switches, their time and memory, the log-prob check, the fallback."""
        if self.fallback is not None:
            return {"hybrid_engine": False, "hybrid_fallback_reason": self.fallback_reason}
        out: dict[str, float | int | str | bool | None] = {
            "hybrid_engine": True,
            "inference_tp_size": self.tp.size,
            "hybrid_mode": "unpinned" if self.copy is None else "inference_copy",
            "hybrid_switches": self.switches,
            "hybrid_switch_seconds": self.switch_seconds,
            "hybrid_first_switch_seconds": self.first_switch_seconds,
            **self.logprob_diff,
        }
        if self.copy is not None:
            out["hybrid_inference_copy_mb"] = self.copy.copy_bytes / 2**20
            out["hybrid_gather_peak_mb"] = self.gather_peak_bytes / 2**20
        if self.device_peak_bytes:
            out["hybrid_switch_device_peak_mb"] = self.device_peak_bytes / 2**20
        return out


def _all_max(x: float) -> float:
    if not dist.is_initialized() or dist.world_size() == 1:
        return x
    import torch.distributed as tdist

    t = torch.tensor([x], dtype=torch.float64, device=dist.default_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t)
