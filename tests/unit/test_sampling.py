"""dschat.generation.sampling: the one options type of every generator, its checks and its
``generate`` arguments; and the inference tools' shared decoding group built on it."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from dschat.generation.decoding import DecodeOptions, add_decoding_args, decode_options
from dschat.generation.hybrid import HybridGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.utils.errors import UserError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "--max_new_tokens 0: must be at least 1"),
        ({"temperature": 0.0}, "--temperature 0.0: must be a finite number > 0"),
        # inf passed "> 0" and sampling then drew from NaN probabilities (a traceback)
        ({"temperature": float("inf")}, "--temperature inf: must be a finite number > 0"),
        ({"temperature": float("nan")}, "--temperature nan: must be a finite number > 0"),
        ({"top_p": 0.0}, "--top_p 0.0: must be in (0, 1]"),
        ({"top_k": -2}, "--top_k -2: must be >= 0"),
        ({"min_new_tokens": 9}, "--min_new_tokens 9: must be in [0, max_new_tokens]"),
    ],
)
def test_bad_sampling_names_its_flag(kwargs, message):
    with pytest.raises(UserError) as err:
        SamplingConfig(**{"max_new_tokens": 8, **kwargs}).validate()
    assert str(err.value).startswith(message)


def test_a_field_can_be_checked_under_another_flag():
    with pytest.raises(UserError, match=r"^--max_answer_seq_len 0: must be at least 1"):
        SamplingConfig(max_new_tokens=0).validate({"max_new_tokens": "--max_answer_seq_len"})


def test_generate_kwargs_greedy_blanks_the_sampling_fields():
    assert SamplingConfig(max_new_tokens=5, temperature=0.3, do_sample=False).generate_kwargs() == {
        "max_new_tokens": 5,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    sampled = SamplingConfig(max_new_tokens=5, temperature=0.3, top_p=0.8, top_k=7, min_new_tokens=2)
    assert sampled.generate_kwargs() == {
        "max_new_tokens": 5,
        "do_sample": True,
        "min_new_tokens": 2,
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 7,
    }


def test_decode_options_build_on_sampling_config():
    opts = DecodeOptions(
        "sample", max_new_tokens=9, temperature=0.5, top_p=0.7, top_k=3, repetition_penalty=1.2
    )
    assert opts.sampling == SamplingConfig(
        max_new_tokens=9, temperature=0.5, top_p=0.7, top_k=3, do_sample=True
    )
    assert opts.generate_kwargs() == {
        **opts.sampling.generate_kwargs(),
        "repetition_penalty": 1.2,
        "num_beams": 1,
    }
    beam = DecodeOptions("beam", num_beams=3).generate_kwargs()
    assert (beam["do_sample"], beam["num_beams"], beam["early_stopping"]) == (False, 3, True)


def parse(defaults: DecodeOptions, argv: list[str], strategies=("greedy", "sample", "beam", "contrastive")):
    p = argparse.ArgumentParser()
    add_decoding_args(p, defaults, strategies)
    return decode_options(p.parse_args(argv), defaults)


def test_each_tool_keeps_its_defaults_in_the_shared_group():
    chat = DecodeOptions(strategy="sample", max_new_tokens=128, temperature=0.7, top_p=0.9, top_k=50)
    assert parse(chat, [], ("sample", "greedy")) == chat
    assert parse(DecodeOptions(), []) == DecodeOptions()
    # contrastive search compares candidates: its top_k default is 4, not the sampling default 0
    assert parse(DecodeOptions(), ["--decoding", "contrastive"]).top_k == 4
    assert parse(DecodeOptions(), ["--decoding", "contrastive", "--top_k", "3"]).top_k == 3
    with pytest.raises(UserError, match=r"--temperature 0\.0"):
        parse(chat, ["--temperature", "0"], ("sample", "greedy"))


def test_a_flag_the_strategy_does_not_read_is_refused():
    """prompt_eval --temperature 0.7 without --decoding sample decoded greedily and reported nothing."""
    chat = DecodeOptions(strategy="sample", max_new_tokens=128, temperature=0.7, top_p=0.9, top_k=50)
    for argv, flag in ((["--temperature", "0.7"], "--temperature 0.7"), (["--top_p", "0.5"], "--top_p 0.5"),
                       (["--top_k", "5"], "--top_k 5"), (["--num_beams", "2"], "--num_beams 2"),
                       (["--penalty_alpha", "0.3"], "--penalty_alpha 0.3")):  # fmt: skip
        with pytest.raises(UserError, match=rf"^{flag}: --decoding greedy does not read it"):
            parse(DecodeOptions(), argv)
    assert parse(DecodeOptions(), ["--decoding", "greedy", "--temperature", "0"]).strategy == "greedy"
    assert parse(chat, ["--decoding", "greedy"], ("sample", "greedy")).strategy == "greedy"  # its defaults
    assert parse(DecodeOptions(), ["--decoding", "beam", "--num_beams", "2"]).num_beams == 2
    # given at the tool's default value it is still given, and still unread: refused alike
    for argv, flag in (
        (["--num_beams", "4"], "--num_beams 4"),
        (["--penalty_alpha", "0.6"], "--penalty_alpha 0.6"),
    ):
        with pytest.raises(UserError, match=rf"^{flag}: --decoding greedy does not read it"):
            parse(DecodeOptions(), argv)
    with pytest.raises(UserError, match=r"^--temperature 0\.7: --decoding greedy does not read it"):
        parse(chat, ["--decoding", "greedy", "--temperature", "0.7"], ("sample", "greedy"))


def test_chats_greedy_switch_and_another_decoding_conflict():
    """chat.py --greedy --decoding sample sampled (the two wrote one destination, the last won)."""
    chat = DecodeOptions(strategy="sample", max_new_tokens=128, temperature=0.7, top_p=0.9, top_k=50)
    p = argparse.ArgumentParser()
    add_decoding_args(p, chat, ("sample", "greedy"), greedy_switch=True)
    with pytest.raises(UserError, match=r"^--greedy and --decoding sample: give one$"):
        decode_options(p.parse_args(["--greedy", "--decoding", "sample"]), chat)
    assert decode_options(p.parse_args(["--greedy"]), chat).strategy == "greedy"
    assert decode_options(p.parse_args(["--greedy", "--decoding", "greedy"]), chat).strategy == "greedy"
    assert decode_options(p.parse_args([]), chat) == chat


def test_hybrid_engine_under_zero3_needs_the_gather():
    # without it the inference copy would be filled from empty ZeRO-3 partitions
    engine = SimpleNamespace(device=torch.device("cpu"), module=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="gather="):
        HybridGenerator(engine, None, SamplingConfig(max_new_tokens=1), zero3=True)
