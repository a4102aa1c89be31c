"""The model cache under concurrency and failure: one builder, complete entries only, nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dschat.models import builtin, cache
from dschat.utils.dist import free_port
from dschat.utils.errors import UserError
from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "integration" / "cache_script.py"


def _load_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 50, 60, 70]])).logits


def _fresh_micro_logits() -> torch.Tensor:
    from transformers import LlamaForCausalLM

    config = builtin.build_config("micro-llama", len(builtin.build_tokenizer()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 50, 60, 70]])).logits


@pytest.mark.slow
def test_two_ranks_materialise_one_model_concurrently_on_an_empty_cache(tmp_path):
    # transformers' save_pretrained writes nothing on rank 1 once torch.distributed is up: the old cache
    # let rank 1's tokenizer-only copy win the rename and every later run failed on it.
    env = {**os.environ, "DSCHAT_CACHE": str(tmp_path), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "builtin:micro-llama"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    entry = Path(paths.pop())
    assert cache.is_complete(entry)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert not [p for p in entry.parent.iterdir() if p.name.endswith(".tmp")]
    torch.testing.assert_close(_load_logits(str(entry)), _fresh_micro_logits(), rtol=0, atol=0)


@pytest.mark.parametrize("leftover", ["tokenizer-only", "older-format"])
def test_an_incomplete_or_older_entry_is_rebuilt(tmp_path, monkeypatch, leftover):
    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path))
    entry = tmp_path / "models" / "micro-llama-v1-seed0"
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{}")  # what the race used to leave: a tokenizer, no model
    if leftover == "older-format":  # complete, but written before tied weights kept the embedding's name
        (entry / cache.COMPLETE).write_text('{"built_at": "2026-11-22T10:00:00"}')
    path = builtin.materialize("builtin:micro-llama")
    assert Path(path) == entry and cache.is_complete(entry)
    torch.testing.assert_close(_load_logits(path), _fresh_micro_logits(), rtol=0, atol=0)


def test_a_failed_build_leaves_nothing_and_the_next_one_succeeds(tmp_path):
    entry = tmp_path / "thing"

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cache.build_once(entry, broken)
    assert not entry.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".thing.lock"]

    calls = []

    def good(tmp: Path) -> dict:
        calls.append(1)
        (tmp / "data").write_text("ok")
        return {"source": "test"}

    assert cache.build_once(entry, good) == entry
    assert cache.build_once(entry, good) == entry  # complete: not built again
    assert calls == [1] and (entry / "data").read_text() == "ok"


def _tied_lm():
    """A tiny Llama whose LM head is its input embedding (as in SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_a_tied_model_written_to_the_cache_keeps_its_embeddings_for_every_head(tmp_path):
    # A tied model (SmolLM2) has one tensor under two names. Stored under the output head's name, a
    # model without that head (a reward model or critic, AutoModelForSequenceClassification) found no
    # embedding in the file and trained on random ones, silently.
    from transformers import AutoModel, AutoModelForCausalLM

    from dschat.models.reward import load_reward_model

    lm = _tied_lm()
    cache.write_model_dir(lm, None, tmp_path / "m")
    embedding = lm.get_input_embeddings().weight
    body = AutoModel.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert torch.equal(body.get_input_embeddings().weight, embedding)
    reward = load_reward_model(str(tmp_path / "m")).hf_model
    assert torch.equal(reward.get_input_embeddings().weight, embedding)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert torch.equal(again.get_output_embeddings().weight, embedding)


def test_a_reward_model_refuses_a_checkpoint_without_its_embedding(tmp_path):
    # What format-1 cache entries held: the tied tensor only under lm_head.weight.
    from safetensors.torch import save_file

    from dschat.models.reward import load_reward_model
    from dschat.utils.errors import UserError

    lm = _tied_lm()
    (tmp_path / "m").mkdir()
    lm.config.save_pretrained(tmp_path / "m")
    state = {k: v for k, v in lm.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(UserError, match=r"lacks 1 body weight\(s\) \(model.embed_tokens.weight\)"):
        load_reward_model(str(tmp_path / "m"), flag="--critic_model_name_or_path")


def test_a_build_killed_midway_leaves_a_copy_that_the_next_build_removes(tmp_path):
    """A process killed while building (no exception handler runs) leaves its temporary copy, a whole
    model's worth of disk; the next build of the entry, holding the lock, removes it."""
    entry = tmp_path / "thing"
    dead = tmp_path / ".thing.999999.tmp"  # the copy of a build whose process is gone
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1024)

    def build(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"y")

    cache.build_once(entry, build)
    assert cache.is_complete(entry) and not dead.exists()


def test_a_stale_copy_of_an_entry_whose_name_holds_glob_characters_is_removed(tmp_path):
    """The stale copies were found with a glob built from the entry's name (a GGUF file's stem): a name
    holding '[' matched nothing, or other entries' copies."""
    entry = tmp_path / "gguf-model[v2]-0123"
    dead = tmp_path / ".gguf-model[v2]-0123.999999.tmp"
    dead.mkdir()
    cache.build_once(entry, lambda tmp: (tmp / "model.safetensors").write_bytes(b"y") and None)
    assert cache.is_complete(entry) and not dead.exists()


def test_an_entry_is_on_disk_before_it_is_complete(tmp_path, monkeypatch):
    """A power loss after the rename could leave an entry with its completion mark beside empty weights:
    the built files and the mark reach the disk before the rename, and the rename itself after it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    entry = tmp_path / "thing"
    cache.build_once(entry, lambda tmp: (tmp / "model.safetensors").write_bytes(b"y") and None)
    moved = events.index(("replace", str(entry)))
    before = [e for e in events[:moved] if isinstance(e, str)]
    assert any(e.endswith("model.safetensors") for e in before) and any(
        e.endswith(cache.COMPLETE) for e in before
    )
    assert str(tmp_path) in events[moved:]


def test_a_cache_that_cannot_be_written_is_one_line_naming_dschat_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DSCHAT_CACHE", str(blocker))
    with pytest.raises(
        UserError, match=r"model cache .*a-file/models: cannot write there .*set DSCHAT_CACHE"
    ):
        builtin.materialize("builtin:micro-llama")
