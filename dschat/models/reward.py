"""Reward model and critic: a transformer body with a scalar head, scoring at the last real token.

The trained module is a Hugging Face ``AutoModelForSequenceClassification`` (``num_labels=1``) wrapped
in :class:`ScalarHeadModel`, whose forward returns one value per token (what PPO's critic needs) and
whose :meth:`ScalarHeadModel.score` picks the value at each sequence's last real token (what the
reward model is trained on). The saved directory loads with ``AutoModelForSequenceClassification``
and gives the same scores.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dschat.data.packing import (
    CUSTOM_MASK_ATTENTION,
    REJECTED,
    custom_mask,
    shared_prompt_mask,
    stop_packing,
    unpack_pair_values,
)
from dschat.losses import gather_last
from dschat.models.attention import causal_only, use_fast_attention
from dschat.models.loading import apply_dropout, has_value_head, load_config, read_config_json, shape_mismatch
from dschat.utils import dist
from dschat.utils.errors import UserError, first_line

LOG = logging.getLogger("dschat")


@dataclass(frozen=True)
class ScoreNormalization:
    """The mean and standard deviation of a reward model's scores, measured by step 2 and saved in the
    model's ``config.json`` (key :attr:`CONFIG_KEY`), so that step 3 can standardise them
    (``--normalize_reward``).

    A pairwise loss sees only differences of scores, so a reward model's offset and scale are arbitrary:
    on the default job's reward model (2026-11-27) the step-1 policy's right answers scored +2 on average
    and its wrong ones -9, and a clip at +-5 flattened 63% of the scores. Standardised scores make the
    clip, the KL coefficient and the truncation penalty mean the same with every reward model. Step 2
    measures on the step-1 policy's own sampled answers where it has them (``source="policy_samples"``:
    Ziegler et al. 2019 normalise the reward model to mean 0, variance 1 under the initial policy), else
    on both answers of its evaluation pairs (``"eval_pairs"``, as OpenRLHF's ``--normalize_reward``).
    Step 3's rollouts come from the same policy but are scored as generated (step 2 scores the cleaned
    answer text), so standardised scores start near, not exactly at, mean 0 and std 1.
    """

    mean: float
    std: float
    source: str  # "policy_samples" | "eval_pairs"
    n: float  # answers measured

    CONFIG_KEY = "score_normalization"

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """(B,) raw scores -> (B,) fp32 standardised scores."""
        return (scores.float() - self.mean) / self.std

    @classmethod
    def from_eval(cls, ev: dict[str, float]) -> ScoreNormalization | None:
        """From step 2's evaluation (:class:`RankingEval`'s dict): the policy samples' score moments where
        it scored some, else the evaluation pairs'; None where neither has a spread to divide by."""
        for source, prefix, n in (("policy_samples", "policy_", ev.get("policy_answers", 0.0)),
                                  ("eval_pairs", "", 2 * ev.get("pairs", 0.0))):  # fmt: skip
            std = ev.get(f"{prefix}score_std", 0.0)
            if n and std > 1e-6:
                return cls(mean=ev[f"{prefix}score_mean"], std=std, source=source, n=n)
        return None

    def to_config(self, config) -> None:
        """Record on a Hugging Face config (saved with the model's ``config.json``)."""
        setattr(config, self.CONFIG_KEY, asdict(self))

    @classmethod
    def clear(cls, config) -> None:
        """Drop statistics a config inherited from the checkpoint it was loaded from (Hugging Face keeps
        unknown keys): they describe that model's scores, not those of the model about to be saved."""
        if hasattr(config, cls.CONFIG_KEY):
            delattr(config, cls.CONFIG_KEY)

    @classmethod
    def read(cls, path: str, flag: str) -> ScoreNormalization:
        """A saved reward model's normalisation (``path``: its directory), or one line saying it has none."""
        stats = (read_config_json(path, flag) or {}).get(cls.CONFIG_KEY)
        if (
            not isinstance(stats, dict)
            or not {"mean", "std", "source", "n"} <= set(stats)
            or not stats["std"] > 0
        ):
            raise UserError(
                f"{flag} {path}: --normalize_reward needs the score mean and std that step 2 saves in the reward "
                f"model's config.json ({cls.CONFIG_KEY!r}); this one has none: retrain it with this version's step 2, "
                "or drop --normalize_reward"
            )
        return cls(**{k: stats[k] for k in ("mean", "std", "source", "n")})


class Fp32ScoreHead(nn.Linear):
    """The scalar head, computed in fp32 from 16-bit hidden states (B, T, H) and weights -> (B, T, 1).

    A bf16 score has 8 bits of mantissa (steps of 2**-7 at 1): two answers a reward model tells apart in
    fp32 tied in 0.6% of HH test pairs, each counted wrong, and PPO read rounding steps as preferences. The
    weights stay in the model's dtype (the same state dict and checkpoints); only the product is fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(x.float(), self.weight.float(), bias)


class ScalarHeadModel(nn.Module):
    """``forward(input_ids (B,T), attention_mask (B,T)) -> values (B,T)``; ``score(...) -> (B,)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # a *ForSequenceClassification model (possibly a peft wrapper of one)
        self.trained_max_len: int | None = None  # step 2's --max_seq_len, where a trained one was loaded
        head = getattr(self.hf_model, "score", None)
        if type(head) is nn.Linear:  # the class only: the module keeps its parameters, and any hook on them
            head.__class__ = Fp32ScoreHead

    @property
    def hf_model(self) -> nn.Module:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return base

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``attention_mask`` (B, T) marks real tokens; a boolean (B, 1, T, T) one (packed pairs,
        :func:`dschat.data.packing.shared_prompt_mask`) says which token sees which, and then
        ``position_ids`` (B, T) must be given."""
        return self.hf_model.score(self.hidden(input_ids, attention_mask, position_ids)).squeeze(-1).float()

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The body's last hidden states (B, T, H), the head's input (masks as in :meth:`forward`)."""
        hf = self.hf_model
        body = getattr(hf, hf.base_model_prefix)
        if attention_mask.dim() == 4:
            attention_mask = self._custom_mask(attention_mask)
        else:
            # Positions skip left padding (PPO's prompts are left-padded), as generate computes them.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            attention_mask = causal_only(attention_mask)  # left padding (PPO's prompts) keeps it
        return body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state

    @torch.no_grad()
    def packing_error(self, batch: dict[str, torch.Tensor], device: torch.device | str) -> float:
        """Relative difference between the body's hidden states of packed pairs (unpacked again) and of the
        unpacked rows, over the rejected answers' tokens: ~1e-7 in fp32 and ~1e-2 in bf16 (SmolLM2) where
        packing is exact, 0.2 and more on SmolLM2 where the model ignores the custom mask or the position
        ids; compare with :func:`packing_tolerance`. The head is not used: a fresh head is zero and would
        hide any difference."""
        mask = batch["attention_mask"].to(device)
        plain = self.hidden(batch["input_ids"].to(device), mask).float()  # (2B, T, H)
        packed = self.hidden(batch["packed_input_ids"].to(device), shared_prompt_mask(batch["packed_segments"].to(device)),
                             batch["packed_position_ids"].to(device)).float()  # fmt: skip
        where = batch["unpack_index"].to(device)  # (2B, T)
        unpacked = unpack_pair_values(packed, where)  # (2B, T, H)
        # Only the rejected answer's tokens can differ (the rest keep their unpacked causal context).
        segment = unpack_pair_values(batch["packed_segments"].to(device), where)
        check = mask.bool() & (segment == REJECTED)
        return float((unpacked - plain)[check].norm() / plain[check].norm().clamp_min(1e-12))

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return gather_last(self(input_ids, attention_mask), attention_mask)

    @property
    def takes_custom_masks(self) -> bool:
        """Whether the attention implementation takes a (B, 1, T, T) mask as given."""
        return getattr(self.hf_model.config, "_attn_implementation", None) in CUSTOM_MASK_ATTENTION

    def _custom_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if not self.takes_custom_masks:
            raise UserError(
                f"attention implementation {self.hf_model.config._attn_implementation!r} takes no custom mask: "
                "use --no_share_prompt"
            )
        dtype = next(self.hf_model.parameters()).dtype
        return custom_mask(allowed, self.hf_model.config._attn_implementation, dtype)


def packing_tolerance(dtype: torch.dtype) -> float:
    """The largest :meth:`ScalarHeadModel.packing_error` that is rounding, not a packing fault: fp32 sums
    the same terms in another order (~1e-7); bf16/fp16 round every layer's output (~1e-2 on SmolLM2)."""
    return 1e-4 if dtype == torch.float32 else 0.05


def pair_values(model, batch: dict[str, torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Per-token values ``(2B, T)`` on ``device`` of a :class:`~dschat.data.collate.PairCollator` batch
    (chosen rows first), from its packed rows when it has them (each prompt computed once) and otherwise
    from the unpacked ones. ``model``: a :class:`ScalarHeadModel` or the DeepSpeed engine around one
    (called through the engine, ZeRO-3 gathers parameters as it always does)."""
    if "packed_input_ids" not in batch:
        return model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
    mask = shared_prompt_mask(batch["packed_segments"].to(device))
    packed = model(batch["packed_input_ids"].to(device), mask, batch["packed_position_ids"].to(device))
    return unpack_pair_values(packed, batch["unpack_index"].to(device))


def settle_share_prompt(model: ScalarHeadModel, collate, train: list, eval_sets: list[list], device) -> None:
    """Keep ``--share_prompt`` (a :class:`~dschat.data.collate.PairCollator` that packs) only where packed
    pairs give the unpacked values on this model: the body's hidden states of two of the ``train`` pairs,
    compared both ways (:meth:`ScalarHeadModel.packing_error`). Otherwise the collator stops packing and
    the already collated ``eval_sets`` (lists of (batch, weight)) lose their packed rows, with a warning.
    ``model``: the engine's module (ZeRO-3 gathers its parameters in the forward as usual). Collective
    where the model takes custom masks (every rank's step 2 calls it at the same point)."""
    why = None
    if not model.takes_custom_masks:
        why = f"attention implementation {model.hf_model.config._attn_implementation!r} takes no custom mask"
    else:
        was_training = model.training
        model.eval()  # no dropout: the two forwards must be comparable
        error = model.packing_error(collate(train[:2]), device)
        model.train(was_training)
        # decided on the worst rank, so that all ranks pack or none does; NaN (a broken pass) fails
        error = dist.all_reduce_max([error if math.isfinite(error) else math.inf])[0]
        if not error <= packing_tolerance(next(model.parameters()).dtype):
            why = f"packed pairs differ from unpacked rows by {error:.2f} (relative) on this model"
    if why is None:
        LOG.info("--share_prompt: packed pairs match unpacked rows (relative difference %.1e)", error)
        return
    LOG.warning("--share_prompt: %s; scoring unpacked rows instead", why)
    stop_packing(collate, eval_sets)


def require_reward_model(path: str, flag: str) -> None:
    """One line unless ``path`` holds a trained reward model (cheap: reads config.json only)."""
    from dschat.inputs import check_model  # a local path that is not there: said so first

    check_model(path, flag)
    if not has_value_head(path):
        raise UserError(
            f"{flag} {path}: not a trained reward model (no sequence-classification value head; "
            "train one with step 2, or pass the step-2 output directory)"
        )


def load_reward_model(
    path: str,
    *,
    tokenizer=None,
    dropout: float | None = None,
    trust_remote_code: bool = False,
    require_trained_head: bool = False,
    flag: str = "--model_name_or_path",
) -> ScalarHeadModel:
    """A reward model/critic from ``path``: a trained reward model, or (unless ``require_trained_head``)
    a causal LM whose body gets a fresh scalar head. A trained one made by step 2 carries the length its
    rows were cut to in training (``trained_max_len``, from its ``dschat_config.json``; None otherwise),
    which scoring outside training keeps to (:func:`dschat.scoring.score_texts`)."""
    from transformers import AutoModelForSequenceClassification

    if require_trained_head:
        require_reward_model(path, flag)
    config = load_config(path, trust_remote_code=trust_remote_code, flag=flag)
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or ())
    if classifier and config.num_labels != 1:  # a causal LM's config says 2 labels too, by default
        raise UserError(
            f"{flag} {path}: a classifier with {config.num_labels} labels, not a reward model (one score per "
            "answer); start from a causal LM or a 1-label reward model"
        )
    apply_dropout(config, dropout)
    config.num_labels = 1
    config.id2label, config.label2id = {0: "score"}, {"score": 0}
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            config=config,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except ValueError as exc:
        raise UserError(f"{flag} {path}: cannot be loaded as a reward model ({first_line(exc)})") from None
    except RuntimeError as exc:  # only transformers' report of weights of other shapes (not OOM, NCCL, ...)
        if not shape_mismatch(exc):
            raise
        raise UserError(f"{flag} {path}: cannot be loaded as a reward model (weights of other shapes than "
                        "its config.json says)") from None  # fmt: skip
    except OSError as exc:  # missing or unreadable weights
        raise UserError(f"{flag} {path}: cannot load its weights ({first_line(exc)})") from None
    # Only the head may start fresh: a body weight missing from the checkpoint would silently train from
    # random values (a tied embedding stored only under the LM head's name did exactly that).
    missing = sorted(k for k in info["missing_keys"] if k.split(".")[0] != "score")
    if missing:
        raise UserError(
            f"{flag} {path}: the checkpoint lacks {len(missing)} body weight(s) ({', '.join(missing[:3])}); "
            "they would start random"
        )
    if not hasattr(model, "score"):
        raise UserError(
            f"{flag} {path}: {type(model).__name__} has no 'score' head; this architecture is not supported"
        )
    out = ScalarHeadModel(use_fast_attention(model))
    if require_trained_head:
        from dschat.utils.run import trained_config

        out.trained_max_len = trained_config(path).get("max_seq_len")
    return out
