"""Win rate of one model's answers over another's, prompt by prompt, under a reward model (or any scores)."""

import datasets
import evaluate

_DESCRIPTION = """How often the fine-tuned answer scores above the baseline answer to the same prompt; a tie
counts half. ``same[i]`` (optional) marks prompts where both answers are the same text: a tie whatever the
scores, since batches padded differently can score one text a rounding error apart."""

_KWARGS = """
Args:
    predictions: the fine-tuned model's scores, one per prompt.
    references: the baseline's scores for the same prompts.
    same: optional, True where both answers are the same text.
Returns:
    win_rate: (wins + ties / 2) / prompts; wins, ties, losses: counts.
Example:
    >>> m = evaluate.load("dschat/evaluation/win_rate")
    >>> m.compute(predictions=[1.0, 2.0], references=[0.0, 2.0])
    {'win_rate': 0.75, 'wins': 1, 'ties': 1, 'losses': 0}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class WinRate(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references, same=None):
        if len(predictions) != len(references) or not predictions:
            raise ValueError("need two equally long, non-empty score lists")
        same = list(same) if same is not None else [False] * len(predictions)
        if len(same) != len(predictions):
            raise ValueError("same must have one entry per prompt")
        wins = sum(f > b and not s for f, b, s in zip(predictions, references, same))
        ties = sum(f == b or s for f, b, s in zip(predictions, references, same))
        n = len(predictions)
        return {"win_rate": (wins + 0.5 * ties) / n, "wins": wins, "ties": ties, "losses": n - wins - ties}
