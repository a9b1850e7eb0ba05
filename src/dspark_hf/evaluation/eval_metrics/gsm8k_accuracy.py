"""GSM8K answer accuracy: the last number of each reply against the reference answer."""

import datasets
import evaluate

from dspark_hf.evaluation.eval_metrics import extract_last_number, numbers_match

_DESCRIPTION = "Accuracy of the last number in each reply against the GSM8K reference answer."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): model replies (free text).
    references (`list[str]`): reference answers ("18").
Returns:
    accuracy (`float`): fraction of replies whose last number equals the answer.
    correct (`list[bool]`): per-item correctness.
    extracted (`list[str | None]`): the number taken from each reply.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Gsm8kAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Cobbe et al., Training Verifiers to Solve Math Word Problems, 2021.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        extracted = [extract_last_number(p) for p in predictions]
        correct = [numbers_match(e, r) for e, r in zip(extracted, references)]
        return {
            "accuracy": sum(correct) / len(correct) if correct else float("nan"),
            "correct": correct,
            "extracted": extracted,
        }
