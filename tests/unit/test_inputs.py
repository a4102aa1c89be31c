"""Inputs named on a command line, checked before any slow start-up (dschat/inputs.py): pure, no model or
process group; each bad input is one line naming the flag as the user wrote it."""

from __future__ import annotations

import re

import pytest

from dschat import config as C
from dschat.inputs import (
    DATA,
    FUNCTION,
    check_data,
    check_inputs,
    check_model,
    check_output_apart,
    import_function,
)
from dschat.utils.errors import UserError


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./missing-dir", "../missing", "~/missing", "a/b/c"])
def test_a_missing_local_model_path_is_one_clear_error(spec):
    # not a hub id (namespace/name): a local path that is not there
    with pytest.raises(UserError, match=r"^--actor-model .*: no such local file or directory$"):
        check_model(spec, "--actor-model")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache; ``cache(name)`` puts a model's config.json into it (the layout
    huggingface_hub reads); offline by default (``HF_HUB_OFFLINE`` as huggingface_hub read it)."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    def cache(name: str) -> None:
        repo = tmp_path / "hub" / f"models--{name.replace('/', '--')}"
        (repo / "snapshots" / "abc123").mkdir(parents=True)
        (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc123")

    return cache


@pytest.mark.parametrize("spec", ["gpt2", "facebook/opt-125m"])
def test_a_hub_id_in_the_cache_passes_the_model_check_offline(hub_cache, spec):
    hub_cache(spec)
    check_model(spec, "--actor-model")


def test_builtins_and_offline_copies_pass_the_model_check_offline(hub_cache):
    check_model("builtin:micro-llama", "--actor-model")
    check_model("HuggingFaceTB/SmolLM2-135M-Instruct", "--actor-model")  # its packaged GGUF, if not cached


@pytest.mark.parametrize("spec", ["gpt2", "no-such-org/no-such-model"])
def test_a_hub_id_neither_cached_nor_downloadable_is_one_line_at_once(hub_cache, monkeypatch, spec):
    # it went to transformers, which retried for over a minute inside the step before failing
    with pytest.raises(UserError, match=rf"^--actor-model {spec}: no such local directory, not in the Hugging "
                                        r"Face cache, and HF_HUB_OFFLINE is set$"):  # fmt: skip
        check_model(spec, "--actor-model")
    import huggingface_hub.constants as hub_constants

    from dschat.models import hub

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UserError, match=r"and the hub is unreachable$"):
        check_model(spec, "--actor-model")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: True)
    check_model(spec, "--actor-model")  # left to transformers: it downloads, or says there is no such model


def test_a_missing_gguf_file_is_a_missing_file_not_a_hub_name(hub_cache):
    with pytest.raises(UserError, match=r"^--actor-model model\.gguf: no such local file or directory$"):
        check_model("model.gguf", "--actor-model")


def test_hub_reachable_asks_the_endpoint_over_http(monkeypatch):
    """Through huggingface_hub's session, at HF_ENDPOINT's own scheme and port (a raw socket to port 443
    took an http:// mirror for unreachable); any HTTP answer counts, a closed port does not."""
    import http.server
    import socket
    import threading

    import huggingface_hub.constants as hub_constants

    from dschat.models import hub

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)  # the session refuses every request offline
    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub.hub_reachable(timeout=2.0)
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    assert not hub.hub_reachable(timeout=2.0)


def test_hub_reachable_is_bounded_even_where_name_resolution_hangs(monkeypatch):
    """A resolver that does not answer (a dead DNS server) blocks in getaddrinfo, which an HTTP timeout
    does not cover: the probe took as long as the resolver before."""
    import socket
    import time

    import huggingface_hub.constants as hub_constants

    from dschat.models import hub

    real = socket.getaddrinfo

    def hanging(*args, **kwargs):
        time.sleep(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://hub.invalid")
    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    start = time.monotonic()
    assert not hub.hub_reachable(timeout=0.5)
    assert time.monotonic() - start < 2.0


def test_the_model_loaders_check_a_hub_id_too(hub_cache):
    # inference tools and steps resolve every model through one function
    from dschat.models.loading import resolve

    with pytest.raises(UserError, match=r"^--model no-org/no-model: no such local directory"):
        resolve("no-org/no-model", "--model")
    hub_cache("no-org/no-model")
    assert resolve("no-org/no-model", "--model") == "no-org/no-model"


def test_an_unknown_builtin_model_lists_the_known_ones():
    with pytest.raises(
        UserError, match=r"^--model_name_or_path builtin:nope: unknown built-in model \(known: "
    ):
        check_model("builtin:nope", "--model_name_or_path")


def test_data_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("")
    # a registered dataset passes offline: a hit in dschat's data cache needs neither the hub nor datasets'
    # cache (data preparation checks it where it loads it: test_sources)
    for spec in ("builtin", "builtin:sort,reverse_words", "d.jsonl", str(tmp_path), "Anthropic/hh-rlhf"):
        check_data(spec, "--data_path")
    with pytest.raises(
        UserError, match=r"^--data-path builtin:sort,nope: unknown built-in task 'nope'; known: "
    ):
        check_data("builtin:sort,nope", "--data-path")
    with pytest.raises(UserError, match=r"^--data_path missing\.jsonl: data file not found$"):
        check_data("missing.jsonl", "--data_path")
    with pytest.raises(UserError, match=r"^--data_path someone/data: not a local file or directory"):
        check_data("someone/data", "--data_path")


def test_a_function_must_import_and_be_callable():
    assert import_function("os.path:join", "--reward_fn")("a", "b") == "a/b"
    with pytest.raises(
        UserError, match=r"^--reward_fn no_such_module:f: cannot import \(ModuleNotFoundError: "
    ):
        import_function("no_such_module:f", "--reward_fn")
    with pytest.raises(UserError, match=r"^--reward_fn os\.path:nope: cannot import \(AttributeError: "):
        import_function("os.path:nope", "--reward_fn")
    with pytest.raises(UserError, match=r"^--reward_fn os:sep: str is not callable$"):
        import_function("os:sep", "--reward_fn")


def test_step3s_reward_function_is_checked_with_the_inputs():
    # before the process group: the step checks DATA and FUNCTION fields (models by the ones it holds); the
    # module is found, not imported (the rank imports it once it has its device and seed)
    from dschat.config.rlhf import PPOArgs

    specs, good = (PPOArgs,), (PPOArgs(reward_fn="os.path:join"),)
    check_inputs(specs, good, kinds=(DATA, FUNCTION))
    for bad, error in (("no_such_module:f", "No module named 'no_such_module'"),
                       ("no_such_package.mod:f", "No module named 'no_such_package'")):  # fmt: skip
        with pytest.raises(
            UserError, match=rf"^--reward_fn {bad}: cannot import \(ModuleNotFoundError: {error}\)$"
        ):
            check_inputs(specs, (PPOArgs(reward_fn=bad),), kinds=(DATA, FUNCTION))
    # same line as the loader's, where the check and the use meet the same missing module
    with pytest.raises(UserError) as loaded:
        import_function("no_such_module:f", "--reward_fn")
    with pytest.raises(UserError) as checked:
        check_inputs(specs, (PPOArgs(reward_fn="no_such_module:f"),), kinds=(DATA, FUNCTION))
    assert str(checked.value) == str(loaded.value)


def test_check_inputs_walks_the_marked_fields_and_names_prefixed_flags(tmp_path):
    specs = ((C.ModelArgs, "actor_", ()), (C.ModelArgs, "critic_", ()), C.DataArgs)
    fine = (C.ModelArgs("builtin:micro-llama"), C.ModelArgs("builtin:micro-llama"), C.DataArgs())
    check_inputs(specs, fine)
    missing = str(tmp_path / "step2")
    bad_critic = (fine[0], C.ModelArgs(missing), fine[2])
    with pytest.raises(UserError, match=re.escape(f"--critic_model_name_or_path {missing}: no such local")):
        check_inputs(specs, bad_critic)
    check_inputs(specs, bad_critic, kinds=(DATA,))  # models left to the step: an earlier step writes them
    bad_data = (fine[0], fine[1], C.DataArgs(data_path=["builtin"], sft_only_data_path=["gone.json"]))
    with pytest.raises(UserError, match=r"^--sft_only_data_path gone\.json: data file not found$"):
        check_inputs(specs, bad_data, kinds=(DATA,))


def test_a_model_in_the_output_directory_is_refused(tmp_path):
    """A run wrote its weights, config and tokenizer over a model it read from its own --output_dir (a
    plain Hugging Face directory has no summary.json, so nothing stopped it): the model may be neither the
    output directory nor inside it; beside it, above it, or a hub id is fine."""
    model = tmp_path / "my-llama"
    (model / "actor").mkdir(parents=True)
    with pytest.raises(
        UserError, match=re.escape(f"--model_name_or_path {model}: is --output_dir {model}, which")
    ):
        check_output_apart(str(model), [(str(model), "--model_name_or_path")])
    with pytest.raises(
        UserError, match=r"^--actor_model_name_or_path .*actor: lies inside --output_dir .*my-llama/\., "
    ):
        check_output_apart(f"{model}/.", [(str(model / "actor"), "--actor_model_name_or_path")])
    for out in (tmp_path / "out", model / "actor" / "next", tmp_path / "my-llama2"):
        check_output_apart(
            str(out), [(str(model / "actor"), "--m"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "--m")]
        )
    # through a step's groups: the model and the run's output directory are one path
    specs = (C.ModelArgs, C.RunArgs)
    with pytest.raises(UserError, match=r"^--model_name_or_path .*my-llama: is --output_dir "):
        check_inputs(specs, (C.ModelArgs(str(model)), C.RunArgs(output_dir=str(model))))
    check_inputs(specs, (C.ModelArgs(str(model)), C.RunArgs(output_dir=str(tmp_path / "out"))))


def test_every_option_naming_a_model_or_data_is_marked():
    # an unmarked one would be found bad only after the process group had started
    import dataclasses

    import dschat.config.groups as groups
    import dschat.config.rlhf as rlhf

    # step 3 checks these by which models it holds (dschat.rlhf.models.check_model_paths): the reward model
    # defaults to the critic's path, which a function reward never reads
    by_held_models = {"reward_model_name_or_path", "judge_reward_model"}
    options = [
        f
        for module in (groups, rlhf)
        for cls in vars(module).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__
        for f in dataclasses.fields(cls)
        if "help" in f.metadata
        and f.default is not False  # an option (not a switch such as --offload_X_model)
    ]
    names = re.compile(r"model_name_or_path$|_model$|_from$|data_path$|dataset_name$")
    unmarked = {f.name for f in options if names.search(f.name) and not f.metadata.get("input")}
    assert unmarked == by_held_models
    assert {f.name for f in options if f.metadata.get("input")} >= {
        "model_name_or_path", "data_path", "sft_only_data_path", "policy_negatives_from",
        "policy_negatives_reward_model", "ref_model_name_or_path", "unsupervised_dataset_name",
    }  # fmt: skip
