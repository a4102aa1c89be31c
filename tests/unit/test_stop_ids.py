"""Where replies stop: every generator (PPO rollouts, held-out evaluation, chat, prompt_eval) stops at the
format's end of turn, the tokenizer's EOS and every EOS of the model's generation config (Llama 3 and
Qwen2.5 list several there), through one function, dschat.generation.stops.stop_ids_for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dschat.data.prompt_format import prompt_format
from dschat.generation.decoding import DecodeOptions, generate_replies
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import model_eos_ids, stop_ids_for
from dschat.generation.streaming import ReplyStream
from dschat.generation.texts import generate_text_replies
from tests.tiny_chat_models import chain_model

PROMPT = "\n\nHuman: what is it?\n\nAssistant:"


@pytest.fixture(scope="module")
def listed_eos(tmp_path_factory):
    """A chain model that answers ' 57X9' and whose generation config lists 'X' as a second EOS."""
    path = chain_model(tmp_path_factory.mktemp("eos") / "m", " 57X9")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    x = tokenizer.encode("X", add_special_tokens=False)[0]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, x]
    return model, tokenizer, x


def test_stop_ids_for_adds_the_generation_configs_eos_list_after_the_formats_ids():
    tok = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7, 9]))
    assert stop_ids_for(tok, (5, 2)) == (5, 2)
    assert stop_ids_for(tok, (5, 2), model) == (5, 2, 7, 9)
    assert stop_ids_for(tok, (), SimpleNamespace(module=model)) == (2, 7, 9)  # a DeepSpeed engine's model
    assert model_eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=4))) == (4,)
    assert model_eos_ids(SimpleNamespace()) == ()


def test_every_generator_stops_at_an_eos_the_generation_config_lists(listed_eos):
    model, tokenizer, x = listed_eos
    fmt = prompt_format(tokenizer, "off")
    ids = torch.tensor([fmt.encode_prompts([PROMPT])[0]])
    # PPO rollouts (the plain generator; the hybrid engine takes its stops the same way)
    gen = PlainGenerator(SimpleNamespace(module=model), tokenizer, SamplingConfig(max_new_tokens=8, do_sample=False),
                         zero3=False, stop_ids=fmt.stop_ids)  # fmt: skip
    assert x in gen.stop_ids
    seq = gen.generate(ids, torch.ones_like(ids))
    assert tokenizer.decode(seq[0, ids.shape[1] :], skip_special_tokens=True) == " 57X"
    # held-out evaluation texts
    replies = generate_text_replies(model, tokenizer, [PROMPT], max_new_tokens=8, fmt=fmt)
    assert replies.texts == [" 57X"] and replies.cut_off == [False]
    # prompt_eval
    out = generate_replies(
        model, tokenizer, [ids[0].tolist()], DecodeOptions(max_new_tokens=8), stop_ids=fmt.stop_ids
    )
    assert out.texts == [" 57X"]
    # chat.py: the stop list replaces generate's own, so the config's EOS ids must be in it
    stream = ReplyStream(
        model, tokenizer, ids, {"max_new_tokens": 8, "do_sample": False}, stop_ids=fmt.stop_ids
    )
    list(stream)
    assert stream.text.strip() == "57X"
