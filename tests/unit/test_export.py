"""Export to Hugging Face format (write_hf_model): what is written reloads to the same model, and writing it
builds no second, randomly initialised copy of the model (no random numbers drawn, no fp32 skeleton)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dschat.engine.checkpoint import gather_full_state_dict, write_hf_model
from dschat.models.builtin import build_config
from dschat.models.lora import inject_lora


def _model(kind: str, *, tied: bool, dtype: torch.dtype):
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    config = build_config("micro-llama", vocab_size=64)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    if kind.startswith("value_head"):
        config.num_labels = 1
        config.pad_token_id = 0
        model = LlamaForSequenceClassification(config)
    else:
        model = LlamaForCausalLM(config)
    if kind.endswith("lora") or kind == "lora_head":
        model = inject_lora(
            model, dim=4, alpha=8, module_name="lm_head" if kind == "lora_head" else "layers."
        )
        for name, p in model.named_parameters():  # a trained adapter: lora_B starts at zero
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
    # the weights only: rotary frequencies stay fp32, as from_pretrained keeps them
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


def _outputs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


@pytest.mark.parametrize(
    ("kind", "tied", "dtype"),
    [
        ("causal", True, torch.float32),
        ("causal", False, torch.bfloat16),
        ("lora", True, torch.float32),
        ("lora", False, torch.bfloat16),
        ("value_head", False, torch.bfloat16),
        ("value_head_lora", False, torch.float32),
        # LoRA on a tied head (--lora_module_name lm_head): exported untied, the embedding unchanged; the
        # export crashed (transformers' tie_weights on peft's wrapped head)
        ("lora_head", True, torch.float32),
    ],
)
def test_export_reloads_the_same_model_and_draws_no_random_numbers(tmp_path, kind, tied, dtype):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model = _model(kind, tied=tied, dtype=dtype)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    expected = _outputs(model, ids)
    rng = torch.get_rng_state()
    state = gather_full_state_dict(model)
    before = {k: v.clone() for k, v in state.items()}
    write_hf_model(model, state, None, tmp_path / "out")
    # A skeleton built the ordinary way initialises every weight at random first (seconds and a full
    # fp32 copy of the model, for weights that are overwritten at once): the global RNG would move.
    assert torch.equal(torch.get_rng_state(), rng)
    # The exported model holds the state's own tensors: merging LoRA must not write into them (an EMA's
    # state is exported from its live copy).
    assert all(torch.equal(state[k], v) for k, v in before.items())
    auto = AutoModelForSequenceClassification if kind.startswith("value_head") else AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path / "out", dtype=dtype).eval()
    assert next(reloaded.parameters()).dtype == dtype
    assert not any(p.is_meta for p in reloaded.parameters())
    got = _outputs(reloaded, ids)
    # LoRA merged into the weights rounds differently from the adapter added beside them (in bf16, by a
    # rounding of the merged weights)
    lora_tolerance = 1e-5 if dtype == torch.float32 else 0.05
    tolerance = lora_tolerance if "lora" in kind else 0
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    if kind == "lora_head":
        base = model.get_base_model()
        assert torch.equal(reloaded.model.embed_tokens.weight, base.model.embed_tokens.weight)
        assert not torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    elif tied:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_export_keeps_the_generation_config_and_the_models_dtype(tmp_path):
    """The skeleton is built from the config, whose generation config is rebuilt from config.json: the
    checkpoint's EOS list (Llama 3, Qwen2.5), which generation stops at, was lost. And a state kept in fp32
    (an EMA of a bf16 model) was written in fp32, twice the size, unlike the model it averages."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = _model("causal", tied=False, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[2, 7], temperature=0.7, top_p=0.8, do_sample=True
    )
    fp32_state = {k: v.float() for k, v in gather_full_state_dict(model).items()}
    write_hf_model(model, fp32_state, None, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.generation_config.eos_token_id == [2, 7] and reloaded.generation_config.top_p == 0.8
    assert next(reloaded.parameters()).dtype == torch.bfloat16


def test_a_second_export_into_the_same_directory_leaves_no_file_of_the_first(tmp_path):
    """Files were moved in one by one and nothing removed: a chat template (or a single weights file beside a
    new sharded checkpoint) of an earlier export stayed and was read with the new model. The run's own files
    stay."""
    model = _model("causal", tied=False, dtype=torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "chat_template.jinja").write_text("{{ old }}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (out / "metrics.jsonl").write_text("{}\n")
    write_hf_model(model, gather_full_state_dict(model), None, out)
    names = {p.name for p in out.iterdir()}
    assert "chat_template.jinja" not in names and "model-00001-of-00002.safetensors" not in names
    assert {"model.safetensors", "config.json", "metrics.jsonl"} <= names


def test_what_a_killed_save_left_is_removed_by_the_next(tmp_path):
    """A save killed mid-way left a whole model in ``.export-*`` (and a checkpoint in ``.tmp-stepM``,
    removed only when a later save reached that very step): nothing ever read them, and each held the
    model's size on disk."""
    from dschat.engine.checkpoint import save_checkpoint

    model = _model("causal", tied=False, dtype=torch.float32)
    out = tmp_path / "out"
    (out / ".export-killed").mkdir(parents=True)
    (out / ".export-killed" / "model.safetensors").write_bytes(b"half")
    write_hf_model(model, gather_full_state_dict(model), None, out)
    assert not [p for p in out.iterdir() if p.name.startswith(".export-")]

    class Saver:  # what save_checkpoint asks of an engine: a directory per tag
        def save_checkpoint(self, root, tag, client_state, save_latest):
            (tmp_path / "ckpt" / tag).mkdir(parents=True)

    (tmp_path / "ckpt" / ".tmp-step7").mkdir(parents=True)
    save_checkpoint(Saver(), tmp_path / "ckpt", 4, {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step4"]


def test_exported_and_cached_weights_are_readable_as_any_written_file(tmp_path):
    """safetensors writes owner-only files (0600): an export, or a model-cache entry shared between jobs,
    was unreadable to another user who could read the directory; they get a plain open()'s mode now."""
    import os

    from dschat.models.cache import write_model_dir

    mask = os.umask(0o022)
    try:
        model = _model("causal", tied=True, dtype=torch.float32)
        write_hf_model(model, gather_full_state_dict(model), None, tmp_path / "out")
        write_model_dir(model, None, tmp_path / "cache-entry")
    finally:
        os.umask(mask)
    for f in [*(tmp_path / "out").iterdir(), *(tmp_path / "cache-entry").iterdir()]:
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_an_export_killed_while_its_files_move_in_is_refused_by_the_loaders(tmp_path, monkeypatch):
    """The files of an export move into the directory one by one (it holds the run's own files too, so it
    cannot be swapped whole): killed between two moves, the new weights sat beside the old config.json
    and loaded as a model. A marker stands in the directory while they move; loading it is one line."""
    from dschat.engine import checkpoint
    from dschat.models.loading import load_config
    from dschat.utils.errors import UserError

    model = _model("causal", tied=False, dtype=torch.float32)
    out = tmp_path / "out"
    write_hf_model(model, gather_full_state_dict(model), None, out)
    load_config(str(out))  # a finished export loads
    real, moved = checkpoint.os.replace, []

    def killed_after_one(src, dst):
        if moved:
            raise KeyboardInterrupt  # the process ends here
        moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        write_hf_model(model, gather_full_state_dict(model), None, out)
    monkeypatch.setattr(checkpoint.os, "replace", real)
    with pytest.raises(UserError, match=r"^--model_name_or_path .*out: an export into it was interrupted"):
        load_config(str(out))
    write_hf_model(model, gather_full_state_dict(model), None, out)  # the next export completes it
    load_config(str(out))


def test_pruning_never_deletes_the_checkpoint_just_saved(tmp_path):
    """Pruning kept the numerically highest steps: after a resume from step 400 (step 600 of an abandoned
    continuation still there) the save of step 500 with keep=1 deleted step 500 itself, leaving 'latest'
    naming nothing. Checkpoints above the one just saved belong to the abandoned run and go."""
    from dschat.engine.checkpoint import latest_tag, save_checkpoint

    class Saver:  # what save_checkpoint asks of an engine: a directory per tag
        def save_checkpoint(self, root, tag, client_state, save_latest):
            (Path(root) / tag).mkdir(parents=True)

    root = tmp_path / "ckpt"
    for step in (400, 600):
        save_checkpoint(Saver(), root, step, {}, keep=2)
    (root / "latest").write_text("step400\n")  # resumed from step 400
    save_checkpoint(Saver(), root, 500, {}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step500"]
    assert latest_tag(root) == "step500"
