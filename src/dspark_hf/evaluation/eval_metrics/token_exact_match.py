"""Exact match of token-id sequences: the greedy-identity check of speculative decoding.

Predictions and references are token ids written as space-joined strings (see
`dspark_hf.evaluation.eval_metrics.token_string`). The score is the fraction of identical sequences; for greedy
speculative decoding against the target alone it must be exactly 1.0.
"""

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions whose token-id sequence is identical to the reference's."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): token ids of each generated sequence, space-joined ("5 17 3").
    references (`list[str]`): token ids of the reference sequence, same format.
Returns:
    exact_match (`float`): fraction of identical sequences, in [0, 1].
    matches (`list[bool]`): per-item identity.
Examples:
    >>> metric = evaluate.load("token_exact_match.py")
    >>> metric.compute(predictions=["1 2 3", "4 5"], references=["1 2 3", "4 6"])["exact_match"]
    0.5
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokenExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        matches = [p.split() == r.split() for p, r in zip(predictions, references)]
        return {"exact_match": sum(matches) / len(matches) if matches else float("nan"), "matches": matches}
