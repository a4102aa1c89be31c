"""Loading a model-or-adapter path for the inference tools, and the one-line errors of bad paths."""

from __future__ import annotations

import json

import pytest
import torch

from dschat.models.loading import inference_dtype, load_for_generation
from dschat.utils.errors import UserError
from tests.tiny_chat_models import chain_model, lora_adapter, sign_reward_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from dschat.models.builtin import build_config, build_tokenizer

    d = tmp_path_factory.mktemp("base")
    tok = build_tokenizer()
    torch.manual_seed(1)
    LlamaForCausalLM(build_config("micro-llama", len(tok))).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_adapter_is_loaded_on_its_base_and_merged(base_dir, tmp_path):
    """Logits of the loaded adapter == those of peft's unmerged base + adapter, and != the base's."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    adapter = lora_adapter(tmp_path / "adapter", base_dir)
    model, tok = load_for_generation(str(adapter))
    assert tok.padding_side == "left" and model.config.use_cache and not model.training
    assert not hasattr(model, "peft_config")  # merged into a plain model
    ids = torch.tensor([tok("\n\nHuman: hi\n\nAssistant:")["input_ids"]])
    reference = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter).eval()
    base = LlamaForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        got, want, plain = (m(input_ids=ids).logits for m in (model, reference, base))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3


def test_adapter_without_its_base(base_dir, tmp_path):
    adapter = lora_adapter(tmp_path / "adapter", base_dir)
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "moved-away")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"adapter's base model .*moved-away.*pass --base_model PATH"):
        load_for_generation(str(adapter))
    model, _ = load_for_generation(str(adapter), base_model=str(base_dir))  # the way out the error names
    assert model is not None
    # a hub base that is not cached, offline: named as the adapter's config names it, not as a flag not given
    cfg["base_model_name_or_path"] = "no-org/no-base"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        UserError, match=r"adapter's base model \(its adapter_config\.json\) no-org/no-base: no such local"
    ):
        load_for_generation(str(adapter))
    cfg["base_model_name_or_path"] = None
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="does not name its base model; pass --base_model"):
        load_for_generation(str(adapter))


def test_paths_that_are_not_generating_models(tmp_path):
    step3 = tmp_path / "step3"
    chain_model(step3 / "actor", " 1")
    with pytest.raises(
        UserError, match=r"no config.json, not a model directory \(model directories inside: actor\)"
    ):
        load_for_generation(str(step3))
    with pytest.raises(UserError, match="is a reward model"):
        load_for_generation(str(sign_reward_model(tmp_path / "rm")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="is a file, not a model directory"):
        load_for_generation(str(tmp_path / "notes.txt"))
    with pytest.raises(UserError, match="--path /no/such/model: no such local file or directory"):
        load_for_generation("/no/such/model")
    with pytest.raises(UserError, match="--path builtin:nope: unknown built-in model"):
        load_for_generation("builtin:nope")


@pytest.mark.parametrize("text", ['{"model_type": "llama", ', "[]", "null"])
def test_a_broken_config_json_is_one_line(tmp_path, text):
    """A truncated config.json was a JSONDecodeError traceback, a list an AttributeError, and the model
    loaders called the directory one 'without a config.json'."""
    from dschat.models.loading import has_value_head, load_config

    (tmp_path / "config.json").write_text(text)
    for call in (lambda: load_for_generation(str(tmp_path)), lambda: has_value_head(str(tmp_path)),
                 lambda: load_config(str(tmp_path))):  # fmt: skip
        with pytest.raises(UserError, match=r"config\.json: not a JSON object"):
            call()


def test_inference_dtype(monkeypatch):
    from dschat.engine import core

    # on CPU, auto is what training's auto picks there: bf16 only where the CPU computes it in hardware
    monkeypatch.setattr(core, "bf16_native", lambda: True)
    assert inference_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(core, "bf16_native", lambda: False)
    assert inference_dtype("auto", "cpu") == torch.float32
    assert inference_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(UserError, match="--dtype fp16: half precision needs a GPU"):
        inference_dtype("fp16", "cpu")


def test_a_step_names_a_missing_model_path_in_one_line(tmp_path):
    # a step reports the missing path through the tokenizer load too, not transformers' repo-id message
    from dschat.models.loading import load_tokenizer
    from dschat.utils.errors import UserError

    with pytest.raises(UserError, match="neither a local model directory nor downloadable") as e:
        load_tokenizer(str(tmp_path / "gone" / "model"))
    assert "Repo id" not in str(e.value).split("(")[0]


def test_a_model_directory_without_weights_is_one_line(base_dir, tmp_path):
    """An interrupted save leaves config.json and the tokenizer: one line before any slow work, from
    the inference tools' loader and from the steps' own loaders (transformers raises OSError there)."""
    import shutil

    from dschat.models.loading import load_causal_lm
    from dschat.models.reward import load_reward_model

    bare = tmp_path / "bare"
    shutil.copytree(base_dir, bare)
    for f in bare.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(UserError, match=r"--path .*bare: holds config.json but no weights"):
        load_for_generation(str(bare))
    with pytest.raises(UserError, match=r"--model_name_or_path .*bare: cannot load its weights"):
        load_causal_lm(str(bare))
    with pytest.raises(UserError, match=r"--model_name_or_path .*bare: cannot load its weights"):
        load_reward_model(str(bare))


def test_a_reward_model_given_as_a_causal_lm_is_one_line(base_dir, tmp_path):
    """A step-2 output (body and score head, no LM head) loaded as a policy started with a random LM head,
    silently: every causal-LM weight the checkpoint lacks is refused, as the reward model's body is."""
    from transformers import LlamaForSequenceClassification

    from dschat.models.loading import load_causal_lm

    rm = tmp_path / "rm"
    LlamaForSequenceClassification.from_pretrained(base_dir, num_labels=1).save_pretrained(rm)
    with pytest.raises(
        UserError, match=r"--actor .*rm: the checkpoint lacks 1 weight\(s\) \(lm_head.weight\)"
    ):
        load_causal_lm(str(rm), flag="--actor")
    load_causal_lm(str(base_dir))  # a whole causal LM loads


def test_a_two_label_classifier_as_a_reward_model_start_is_one_line(base_dir, tmp_path):
    # transformers raises RuntimeError on the score head's shape (2 x hidden against 1 x hidden)
    from transformers import LlamaForSequenceClassification

    from dschat.models.reward import load_reward_model

    two = tmp_path / "two"
    LlamaForSequenceClassification.from_pretrained(base_dir, num_labels=2).save_pretrained(two)
    with pytest.raises(
        UserError, match=r"--model_name_or_path .*two: a classifier with 2 labels, not a reward"
    ):
        load_reward_model(str(two))
    load_reward_model(str(base_dir))  # a causal LM (whose config also says 2 labels) gets a fresh head


def test_only_a_shape_mismatch_is_reported_as_one(base_dir, monkeypatch):
    # a RuntimeError of another cause (out of memory, a collective failing under ZeRO-3) is not a shape
    # mismatch: it is raised as it is, not turned into a misleading one-line error
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import load_causal_lm

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", oom)
    with pytest.raises(torch.OutOfMemoryError):
        load_causal_lm(str(base_dir))


def test_a_local_path_that_is_not_there_is_said_so(tmp_path, monkeypatch):
    """chat.py --path ./nope printed transformers' complaint about hub repo ids, and rw_eval.py --model ./nope
    'not a trained reward model': the path is simply not there, as train.py already says."""
    from dschat.models.loading import check_for_generation
    from dschat.models.reward import require_reward_model
    from dschat.utils.errors import UserError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^--path \./nope: no such local file or directory$"):
        check_for_generation("./nope", flag="--path")
    with pytest.raises(UserError, match=r"^--model \./nope: no such local file or directory$"):
        require_reward_model("./nope", "--model")
