"""Run by test_architectures.py in its own process: load several architectures from saved directories
under ZeRO-3 through dschat's loading path, train one step each, print one JSON line per architecture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dschat.engine import core
from dschat.engine.ds_config import train_ds_config
from dschat.models.loading import count_parameters, load_causal_lm
from dschat.utils.errors import run_cli


def builders():
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    small = {"vocab_size": 300}
    return {
        "opt": lambda: OPTForCausalLM(OPTConfig(**small, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=128, word_embed_proj_dim=64, pad_token_id=1)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**small, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**small, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**small, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2)),
        # head_dim set apart from hidden / heads, per-head q/k norms (Qwen3); soft-capping, sliding window (Gemma 2)
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**small, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
        "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**small, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         query_pre_attn_scalar=16, sliding_window=4)),
    }  # fmt: skip


def main(workdir: str) -> None:
    core.init_distributed()
    for name, build in builders().items():
        path = Path(workdir) / name
        torch.manual_seed(0)
        plain = build()
        plain.save_pretrained(path)
        expected = sum(p.numel() for p in plain.parameters())
        cfg = train_ds_config(
            zero_stage=3, dtype="fp32", micro_batch_size=2, gradient_accumulation_steps=1, world_size=1
        )
        with core.zero3_loading(cfg):
            model = load_causal_lm(str(path))
        partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
        engine = core.initialize_engine(
            model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), ds_config=cfg
        )
        x = torch.randint(3, 300, (2, 10))
        plain.eval()
        engine.eval()  # OPT and GPT-2 have dropout: compare functions without it
        with torch.no_grad():
            ref = plain(input_ids=x, labels=x).loss.item()
            x_dev = x.to(engine.device)  # the plain reference stays on the CPU
            loss = engine(input_ids=x_dev, labels=x_dev).loss.item()
        engine.train()
        out = engine(input_ids=x_dev, labels=x_dev)
        engine.backward(out.loss)
        engine.step()
        print(json.dumps({"arch": name, "partitioned": partitioned, "params": count_parameters(model), "expected": expected,
                          "loss": loss, "reference_loss": ref, "trained": bool(torch.isfinite(out.loss))}), flush=True)  # fmt: skip


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1]))  # barrier and teardown at the end, as the steps (hybrid_script)
