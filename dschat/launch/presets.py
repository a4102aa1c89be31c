"""Presets (``configs/presets/*.yaml``): per model size and deployment type, the model, the reward
model and each step's flags, which any flag given on the command line overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

from dschat.launch.launcher import DEPLOYMENTS
from dschat.utils.errors import UserError
from dschat.utils.io import read_user_text

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "presets"
DEFAULT_PRESET = (
    "smollm2-135m"  # the main job: a real pretrained chat model (builtin-tiny: tests, smoke runs)
)


PRESET_KEYS = {"model", "reward_model", "deployment_type", "step1", "step2", "step3", "step2_dpo"}

# step flags train.py sets itself, after a preset's (so a preset's value was dropped without a word)
TRAIN_PY_SETS = {
    "--output_dir": "train.py's --output-dir sets (OUTPUT_DIR/stepN for each step)",
    "--model_name_or_path": "train.py sets (step 1 from the preset's model:, later steps from the step before)",
    "--actor_model_name_or_path": "train.py sets to step 1's output",
    "--critic_model_name_or_path": "train.py sets to step 2's output (or the preset's reward_model:)",
    "--overwrite": "is train.py's own switch",
    "--resume": "is train.py's own switch",
    "--node_local_storage": "is train.py's own switch",
}


def read_preset(path: Path) -> dict:
    """A preset file: ``model``, ``reward_model``, ``deployment_type`` and ``stepN: {"--flag": value}``."""
    import yaml

    text = read_user_text(path, str(path))
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: malformed YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of {', '.join(sorted(PRESET_KEYS))}")
    for key, value in data.items():
        if key not in PRESET_KEYS:
            raise UserError(f"{path}: unknown key '{key}' (known: {', '.join(sorted(PRESET_KEYS))})")
        if key.startswith("step"):
            if not isinstance(value, dict) or not all(str(f).startswith("--") for f in value):
                raise UserError(f"{path}: '{key}' must map step flags (--name) to values")
            for flag in value:
                if str(flag) in TRAIN_PY_SETS:
                    raise UserError(
                        f"{path}: '{key}' sets {flag}, which {TRAIN_PY_SETS[str(flag)]}; remove it"
                    )
        elif key in ("model", "reward_model") and not isinstance(value, str):
            raise UserError(f"{path}: {key} must be a model name or path (a string), got {value!r}")
        elif key == "deployment_type" and value not in DEPLOYMENTS:
            raise UserError(f"{path}: deployment_type must be one of {', '.join(DEPLOYMENTS)}, got {value!r}")
    return data


def preset_for_model(model: str, deployment: str | None) -> tuple[Path | None, str]:
    """The preset whose ``model`` is ``model`` (case-insensitive), preferring ``deployment``, else the
    smallest deployment type among that model's presets."""
    matches = []
    for path in sorted(PRESETS.glob("*.yaml")):
        data = read_preset(path)
        if str(data.get("model", "")).lower() == model.lower():
            matches.append((path, data.get("deployment_type")))
    if not matches:
        return None, ""
    exact = [p for p, d in matches if d == deployment]
    if exact:
        how = f" and --deployment-type {deployment}" if deployment else ""
        return exact[0], f"implied by --actor-model {model}{how}"
    matches.sort(key=lambda m: DEPLOYMENTS.index(m[1]) if m[1] in DEPLOYMENTS else len(DEPLOYMENTS))
    return matches[0][0], f"implied by --actor-model {model}"


def load_preset(args: argparse.Namespace) -> dict:
    """The preset (``{"model": ..., "step1": {"--flag": value}, ...}``, empty if none) and ``_name``,
    ``_why`` for the report. Explicit ``--preset``, else the one of ``--actor-model``, else
    :data:`DEFAULT_PRESET`."""
    if args.preset == "none":
        return {}
    if args.preset:
        name = args.preset
        path = Path(name) if name.endswith((".yaml", ".yml")) else PRESETS / f"{name}.yaml"
        why = "--preset"
    elif args.actor_model:
        path, why = preset_for_model(args.actor_model, args.deployment_type)
        if path is None:
            return {}
        name = path.stem
    else:
        name, path, why = (
            DEFAULT_PRESET,
            PRESETS / f"{DEFAULT_PRESET}.yaml",
            "the default without --actor-model",
        )
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise UserError(f"--preset {name}: no such preset (known: {known})")
    return {**read_preset(path), "_name": path.stem, "_why": why}


def preset_flags(preset: dict, step: int | str, output_dir: str | None = None) -> list[str]:
    """The preset's flags of one step (its number, or its section name such as ``step2_dpo``);
    ``{output_dir}`` in a value becomes the run's --output-dir (so a preset can point one step at
    another's output, e.g. ``{output_dir}/step1``)."""
    out: list[str] = []
    for flag, value in (preset.get(step if isinstance(step, str) else f"step{step}") or {}).items():
        if value is True:
            out.append(flag)
        elif value is False:  # a switch set off, whatever the step's default
            out.append(f"--no_{flag.removeprefix('--')}")
        elif value is not None:
            out += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    if output_dir is not None:
        out = [v.replace("{output_dir}", output_dir) for v in out]
    return out
