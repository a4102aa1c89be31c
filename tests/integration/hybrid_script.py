"""Run by test_hybrid_engine.py in its own process(es): real DeepSpeed engines on CPU (gloo), the
hybrid engine against Hugging Face ``generate`` on an unwrapped copy. Prints one JSON line per check.

    python tests/integration/hybrid_script.py single WORKDIR            # 1 rank: equality, state, log-probs
    torchrun --nproc_per_node 2 tests/integration/hybrid_script.py tp WORKDIR   # 2 ranks: TP and ZeRO-3
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dschat.engine import core
from dschat.engine.checkpoint import gather_full_state_dict, write_hf_model
from dschat.engine.core import gather_zero3
from dschat.engine.ds_config import train_ds_config
from dschat.generation.hybrid import HybridGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.models.builtin import materialize
from dschat.models.loading import load_causal_lm, load_tokenizer
from dschat.models.lora import inject_lora
from dschat.utils import dist
from dschat.utils.errors import run_cli
from tests.integration.zero3_archs_script import builders

PROMPTS = [
    ["\n\nHuman: What is 37 + 5?\n\nAssistant:", "\n\nHuman: Sort: pear fig\n\nAssistant:", "hi"],
    ["\n\nHuman: Reverse the letters of abcde\n\nAssistant:", "ok then", "\n\nHuman: What is 1 + 2?"],
]
GREEDY = SamplingConfig(max_new_tokens=12, do_sample=False)


ROWS: list[Path] = []  # where emit() also appends its lines: one file per rank (ranks share stdout)


def emit(**row) -> None:
    line = json.dumps({"rank": dist.rank(), **row})
    print(line, flush=True)
    if ROWS:
        with ROWS[0].open("a") as f:
            f.write(line + "\n")


def build_engine(path: str, tok, *, stage: int, lora: int = 0, steps: int = 1, dtype: str = "fp32"):
    """A trained-for-``steps`` engine (so that weights and LoRA B are no longer at their initial values)."""
    cfg = train_ds_config(zero_stage=stage, dtype=dtype, micro_batch_size=2, gradient_accumulation_steps=1,
                          world_size=dist.world_size())  # fmt: skip
    with core.zero3_loading(cfg):
        model = load_causal_lm(path, tokenizer=tok)
    if lora:
        model = inject_lora(model, dim=lora, only_optimize_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = core.initialize_engine(model, optimizer=torch.optim.AdamW(params, lr=3e-2), ds_config=cfg)
    x = tok(["What is 1 + 1? 2", "Sort: b a -> a b"], return_tensors="pt", padding=True)["input_ids"]
    x = x.to(engine.device)
    for _ in range(steps):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return engine


def reference(engine, tok, workdir: Path, name: str):
    """The engine's weights as an unwrapped Hugging Face model (LoRA merged by peft), via export."""
    out = workdir / name
    write_hf_model(engine.module, gather_full_state_dict(engine.module), tok, out)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(engine.device).eval()


def hf_generate(model, enc, tok, s: SamplingConfig) -> torch.Tensor:
    kw = {"do_sample": s.do_sample, "max_new_tokens": s.max_new_tokens}
    if s.do_sample:
        kw.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    return model.generate(
        **enc, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True, **kw
    )


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Everything training reads: local parameter data (ZeRO-3: this rank's partition), every tensor
    of the optimizer's state dict (ZeRO-3: fp32 partitions and Adam moments), module mode."""
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        out[f"param/{n}"] = local.detach().clone()
        out[f"shape/{n}"] = torch.tensor(list(p.shape))  # ZeRO-3 params stay released (empty)

    def walk(prefix: str, x) -> None:  # fmt: skip
        if torch.is_tensor(x):
            out[prefix] = x.detach().clone()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    walk("optim", engine.optimizer.state_dict())
    out["training"] = torch.tensor(engine.module.training)
    return out


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def single(workdir: Path) -> None:
    path = materialize("builtin:micro-llama")
    tok = load_tokenizer(path, padding_side="left")
    enc = tok(PROMPTS[0] + PROMPTS[1], return_tensors="pt", padding=True).to(dist.default_device())
    for stage, lora in ((0, 0), (3, 0), (3, 4), (0, 4)):
        engine = build_engine(path, tok, stage=stage, lora=lora)
        ref = reference(engine, tok, workdir, f"ref-{stage}-{lora}")
        engine.train()
        before = snapshot(engine)
        gen = HybridGenerator(
            engine, tok, GREEDY, zero3=stage == 3, gather=gather_zero3, static_cache=True
        )  # reused, reset per round
        with gen.generation_mode() as g:
            ours = g.generate(enc["input_ids"], enc["attention_mask"])
        with gen.generation_mode() as g:  # a second round refills the kept copy
            again = g.generate(enc["input_ids"], enc["attention_mask"])
        after = snapshot(engine)
        hf = hf_generate(ref, enc, tok, GREEDY)
        # generate's own draw, so that the same seed gives the same tokens
        sampled = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, draw="multinomial")
        torch.manual_seed(7)
        with gen.generation_mode() as g:
            ours_s = g.generate(enc["input_ids"], enc["attention_mask"], sampled)
        torch.manual_seed(7)
        hf_s = hf_generate(ref, enc, tok, sampled)
        bf16 = HybridGenerator(
            engine, tok, GREEDY, zero3=stage == 3, gather=gather_zero3, dtype=torch.bfloat16
        )
        with bf16.generation_mode() as g:
            g.generate(enc["input_ids"], enc["attention_mask"])
        released = HybridGenerator(
            engine,
            tok,
            GREEDY,
            zero3=stage == 3,
            gather=gather_zero3,
            gather_layers=1,
            release_cache=True,
            static_cache=True,
        )  # the GPU default, exercised here on CPU
        with released.generation_mode() as g:
            chunked = g.generate(enc["input_ids"], enc["attention_mask"])
        unpinned = HybridGenerator(engine, tok, GREEDY, zero3=stage == 3, gather=gather_zero3, unpin=True)
        with unpinned.generation_mode() as g:
            unpinned_out = g.generate(enc["input_ids"], enc["attention_mask"])
        s = gen.stats()
        emit(check="equal", stage=stage, lora=lora, greedy_equal=torch.equal(ours, hf), again_equal=torch.equal(ours, again),
             sampled_equal=torch.equal(ours_s, hf_s), chunked_equal=torch.equal(chunked, hf),
             unpinned_equal=torch.equal(unpinned_out, hf), state_identical=identical(before, after),
             still_training=engine.module.training, new_tokens=int(ours.shape[1] - enc["input_ids"].shape[1]),
             logprob_max_diff=s["generation_logprob_max_diff"], logprob_tokens=s["generation_logprob_tokens"],
             bf16_logprob_max_diff=bf16.stats()["generation_logprob_max_diff"],
             gather_peak_mb=s["hybrid_gather_peak_mb"], chunked_gather_peak_mb=released.stats()["hybrid_gather_peak_mb"],
             released_copy_numel=sum(p.numel() for p in released.copy.model.parameters()))  # fmt: skip

    # the log-prob check looks again after the first optimizer step: a fresh adapter's B is zero, so only
    # then can it see a LoRA merge gone wrong (here one at twice the scaling)
    from dschat.generation import inference_copy

    right = inference_copy.merged_lora_weight
    for broken in (False, True):
        if broken:
            inference_copy.merged_lora_weight = lambda w, a, b, scaling, fan=False: right(
                w, a, b, 2 * scaling, fan
            )
        engine = build_engine(path, tok, stage=0, lora=4, steps=0)
        gen = HybridGenerator(engine, tok, GREEDY, zero3=False)
        diffs = []
        for _ in range(3):  # untrained, after one step, after two (no third look)
            with gen.generation_mode() as g:
                g.generate(enc["input_ids"], enc["attention_mask"])
            diffs.append(gen.stats()["generation_logprob_max_diff"])
            x = enc["input_ids"]
            engine.backward(engine(input_ids=x, attention_mask=enc["attention_mask"], labels=x).loss)
            engine.step()
        inference_copy.merged_lora_weight = right
        emit(check="remeasure", broken=broken, max_diffs=diffs,
             measured_steps=gen.stats()["generation_logprob_measured_steps"])  # fmt: skip

    # other architectures (ZeRO-3, fp32) against generate on the plain model they were saved from
    for name, build in builders().items():
        torch.manual_seed(0)
        plain = build().eval()
        plain.save_pretrained(workdir / name)
        plain.to(dist.default_device())  # compared on the engine's device
        engine = build_engine(str(workdir / name), tok, stage=3, steps=0)
        gen = HybridGenerator(engine, tok, GREEDY, zero3=True, gather=gather_zero3)
        with gen.generation_mode() as g:
            ours = g.generate(enc["input_ids"], enc["attention_mask"])
        hf = hf_generate(plain, enc, tok, GREEDY)
        emit(check="arch", arch=name, hybrid=gen.stats()["hybrid_engine"], greedy_equal=torch.equal(ours, hf))

    # an architecture without a TP plan: served by its copy at TP 1; at TP 2 it falls back to plain
    # generate, with one warning
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    plain = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=128)).eval()  # fmt: skip
    plain.save_pretrained(workdir / "neox")
    plain.to(dist.default_device())
    engine = build_engine(str(workdir / "neox"), tok, stage=0, steps=0)
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and "hybrid engine" in record.getMessage():
                warnings.append(record.getMessage())

    logging.getLogger("dschat").addHandler(Catch())
    served = HybridGenerator(engine, tok, GREEDY, zero3=False)
    with served.generation_mode() as g:
        ours = g.generate(enc["input_ids"], enc["attention_mask"])
    emit(check="unplanned", hybrid=served.stats()["hybrid_engine"], warnings=list(warnings),
         greedy_equal=torch.equal(ours, hf_generate(plain, enc, tok, GREEDY)))  # fmt: skip
    gen = HybridGenerator(engine, tok, GREEDY, zero3=False, tp_size=2)
    for _ in range(2):
        with gen.generation_mode() as g:
            ours = g.generate(enc["input_ids"], enc["attention_mask"])
    emit(check="fallback", hybrid=gen.stats()["hybrid_engine"], warnings=warnings,
         greedy_equal=torch.equal(ours, hf_generate(plain, enc, tok, GREEDY)))  # fmt: skip


def tp(workdir: Path) -> None:
    """2 ranks: TP 2 equals TP 1 (each rank its own prompts, different counts and lengths), for every
    architecture; ZeRO-3 ranks generating different lengths finish (no hang), pinned and unpinned."""
    path = materialize("builtin:micro-llama")
    tok = load_tokenizer(path, padding_side="left")
    mine = PROMPTS[dist.rank()][: 3 - dist.rank()]  # 3 prompts on rank 0, 2 on rank 1
    enc = tok(mine, return_tensors="pt", padding=True).to(dist.default_device())
    sources = {"llama": path}
    for name, build in builders().items():
        if dist.is_main():
            torch.manual_seed(0)
            build().save_pretrained(workdir / name)
        sources[name] = str(workdir / name)
    dist.barrier()
    for name, src in sources.items():
        engine = build_engine(src, tok, stage=3, steps=1)
        one = HybridGenerator(engine, tok, GREEDY, zero3=True, gather=gather_zero3)
        two = HybridGenerator(engine, tok, GREEDY, zero3=True, gather=gather_zero3, tp_size=2)
        with one.generation_mode() as g:
            a = g.generate(enc["input_ids"], enc["attention_mask"])
        with two.generation_mode() as g:
            b = g.generate(enc["input_ids"], enc["attention_mask"])
        s = two.stats()
        emit(check="tp", arch=name, equal=torch.equal(a, b), shape=list(b.shape), prompt_shape=list(enc["input_ids"].shape),
             copy_mb=s["hybrid_inference_copy_mb"], full_copy_mb=one.stats()["hybrid_inference_copy_mb"],
             logprob_max_diff=s["generation_logprob_max_diff"])  # fmt: skip
    # ranks asking for different lengths: every rank returns (no collective inside pinned decoding;
    # the unpinned ZeRO-3 module steps in lockstep)
    engine = build_engine(path, tok, stage=3, steps=0)
    n = 4 if dist.rank() == 0 else 20
    s = SamplingConfig(max_new_tokens=n, do_sample=True)
    for unpin in (False, True):
        gen = HybridGenerator(engine, tok, s, zero3=True, gather=gather_zero3, unpin=unpin)
        with gen.generation_mode() as g:
            out = g.generate(enc["input_ids"], enc["attention_mask"])
        emit(check="lengths", unpin=unpin, new_tokens=int(out.shape[1] - enc["input_ids"].shape[1]), limit=n)


def main() -> None:
    core.init_distributed()
    ROWS.append(Path(sys.argv[2]) / f"rows-rank{dist.rank()}.jsonl")
    {"single": single, "tp": tp}[sys.argv[1]](Path(sys.argv[2]))


if __name__ == "__main__":
    # run_cli ends as the steps do: every rank at a barrier, then the process group torn down. Ended
    # without it, one rank closed its gloo connections while its peer was still finishing, and the peer
    # aborted at exit after every check had passed ("terminate called without an active exception", ci65)
    run_cli(main)
