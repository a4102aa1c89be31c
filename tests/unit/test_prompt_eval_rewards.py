"""inference/prompt_eval.py's reward scoring: the reward model reads the format and dtype it should."""

from __future__ import annotations

import json

import torch

from dschat.data.prompt_format import HUMAN_ASSISTANT
from dschat.models.builtin import build_tokenizer


class _RM(torch.nn.Module):
    """What rewards() asks of a reward model: ``to`` (recorded) and scoring through score_texts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


def test_the_reward_model_reads_the_format_it_trained_in_whatever_the_policies_are_asked_in(
    tmp_path, monkeypatch
):
    """``--chat_template on`` (how to prompt the two policies) also replaced the format the reward model
    recorded in its dschat_config.json, so it scored the replies in a format it never saw; and it scored in
    fp32 whatever --dtype said (rw_eval.py casts)."""
    import inference.prompt_eval as pe

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "dschat_config.json").write_text(json.dumps({"chat_template": "off"}))
    seen = {}
    rm = _RM()
    monkeypatch.setattr(pe, "resolve", lambda name, flag: str(tmp_path))
    monkeypatch.setattr(pe, "load_tokenizer", lambda *a, **k: tok)
    monkeypatch.setattr(pe, "load_reward_model", lambda *a, **k: rm)

    def score_texts(model, tokenizer, prompts, responses, **kw):
        seen["fmt"], seen["dtype"] = kw["fmt"], next(model.parameters()).dtype
        return torch.zeros(len(responses))

    monkeypatch.setattr(pe, "score_texts", score_texts)
    args = pe.parse_args(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b",
                          "--reward_model", str(tmp_path), "--chat_template", "on", "--device", "cpu",
                          "--dtype", "bf16"])  # fmt: skip
    pe.rewards(["What is 1 + 1?"], {"baseline": [" 2"], "finetune": [" 3"]}, args)
    assert seen["fmt"].name == HUMAN_ASSISTANT
    assert seen["dtype"] == torch.bfloat16
