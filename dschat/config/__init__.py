"""Every command-line option, defined once as typed dataclass fields and shared by all steps.

A step builds its parser from the groups it needs; later steps reuse a group under a prefix
(``--actor_zero_stage`` is :class:`DeepSpeedArgs` with prefix ``actor_``). Validation raises
:class:`UserError` naming the exact flag, and nothing is silently corrected.
"""

from dschat.config.fields import (
    DEFAULT_MODEL,
    DTYPES,
    SCHEDULERS,
    ZERO_STAGES,
    check_zero_stage,
    opt,
    parse_data_split,
)
from dschat.config.groups import (
    DataArgs,
    DeepSpeedArgs,
    DPOArgs,
    FormatArgs,
    InferenceArgs,
    LoraArgs,
    ModelArgs,
    OptimArgs,
    OptimizerArgs,
    PolicyPairsArgs,
    RewardArgs,
    RunArgs,
)
from dschat.config.parsing import (
    ArgumentParser,
    GroupSpec,
    add_group,
    check_resume,
    from_namespace,
    parse_groups,
    to_dict,
)
from dschat.config.rlhf import PPOArgs, RLHFEngineArgs, Step3Models, one_update_per_round, step3_models

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "SCHEDULERS",
    "ZERO_STAGES",
    "ArgumentParser",
    "DPOArgs",
    "DataArgs",
    "DeepSpeedArgs",
    "FormatArgs",
    "GroupSpec",
    "InferenceArgs",
    "LoraArgs",
    "ModelArgs",
    "OptimArgs",
    "OptimizerArgs",
    "PPOArgs",
    "PolicyPairsArgs",
    "RLHFEngineArgs",
    "RewardArgs",
    "RunArgs",
    "Step3Models",
    "add_group",
    "check_resume",
    "check_zero_stage",
    "from_namespace",
    "one_update_per_round",
    "opt",
    "parse_data_split",
    "parse_groups",
    "step3_models",
    "to_dict",
]  # fmt: skip
