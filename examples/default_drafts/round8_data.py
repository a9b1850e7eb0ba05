"""Round 8 of the default drafts: prompts worded like the evaluation's, none of them an evaluation prompt.

    python examples/default_drafts/round8_data.py --output data/prompts_round8.jsonl

Round 7 split the first drafted token's live shortfall and found about 0.04 of it in the evaluation's prompts
themselves: the drafts were trained on "Write a Python function `name(signature)`. Summary." requests (227 of
them, six times each) while HumanEval asks to complete a function from its header and docstring. This file asks
the way the evaluation asks:

- **code**: "Complete this Python function …" around the header and docstring of a documented function (or
  method) from the standard library and a few pure-Python packages, in HumanEval's exact wording; no function
  named like a HumanEval task;
- **chat**: the ShareGPT first turns of round 3's prompt file that rounds 5 and 6 did not answer (all from
  conversations before the held-out slice);
- **math**: templated word problems with a new seed, none a calibration problem.

The rows are sorted by length into chunks of `--chunk` and the chunks shuffled, so a run stopped at a time limit
keeps every length and source.
"""

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import random
import sys
import textwrap
import warnings
from pathlib import Path

from dspark_hf.evaluation.prompt_sets import calibration_prompts, load_prompt_set, training_prompts

CODE_REQUEST = "Complete this Python function. Reply with the whole function in a code block.\n\n```python\n{}```"
# Importing these opens windows, starts servers, prints poems or is a test suite.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "tests", "lib2to3", "ensurepip"}
PACKAGES = ("networkx", "sympy", "mpmath", "jinja2", "packaging", "dateutil", "pygments", "markdown", "click")


def quietly_import(name: str):
    """The module, or None when importing it fails or it is one to skip."""
    if any(part in SKIP or part.startswith("_") for part in name.split(".")):
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - some modules raise SystemExit or odd errors on import
        return None


def modules(top: str):
    """`top` and, for a package, every submodule that imports cleanly."""
    module = quietly_import(top)
    if module is None:
        return
    yield module
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), top + "."):
        sub = quietly_import(info.name)
        if sub is not None:
            yield sub


def function_stubs(module, min_doc: int, max_doc: int):
    """(name, header and docstring) of each public function and method defined in `module`'s source that has a
    docstring of `min_doc`-`max_doc` characters and a body after it."""
    try:
        source = inspect.getsource(module)
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, ValueError):
        return
    lines = source.splitlines()
    nodes = tree.body + [m for n in tree.body if isinstance(n, ast.ClassDef) for m in n.body]
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not min_doc <= len(doc) <= max_doc or len(node.body) < 2:
            continue
        stub = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
        yield node.name, textwrap.dedent(stub)  # a method's stub starts at the left margin like a function's


def main() -> None:
    from prompt_files import write_in_length_chunks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="data/prompts_round8.jsonl")
    parser.add_argument("--round3", default="data/prompts_round3.jsonl", help="round 3's prompt file (its chat rows).")
    parser.add_argument("--answered", type=int, default=6912, help="round 3's rows that rounds 5 and 6 answered.")
    parser.add_argument("--code", type=int, default=1300)
    parser.add_argument("--chat", type=int, default=1300)
    parser.add_argument("--math", type=int, default=400)
    parser.add_argument("--chunk", type=int, default=192, help="prompts sorted by length within each chunk.")
    parser.add_argument("--seed", type=int, default=8, help="a new draw (rounds 1-3 used 0, 2 and 3)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rng = random.Random(args.seed)

    evaluation = {name: load_prompt_set(name) for name in ("gsm8k", "humaneval", "mtbench", "sharegpt")}
    humaneval_names = {item.reference["task"]["entry_point"] for item in evaluation["humaneval"]}
    stubs, seen = {}, set()  # top-level package -> its stubs
    tops = sorted(n for n in sys.stdlib_module_names if not n.startswith("_")) + list(PACKAGES)
    for top in tops:
        for module in modules(top):
            for name, stub in function_stubs(module, min_doc=60, max_doc=900):
                if name not in humaneval_names and stub not in seen and len(stub) <= 1400:
                    seen.add(stub)
                    stubs.setdefault(top if top in PACKAGES else "stdlib", []).append(stub)
    # half from the standard library; sympy alone would otherwise be most of the rest
    n_stdlib = min(args.code // 2, len(stubs["stdlib"]))
    picked = rng.sample(stubs.pop("stdlib"), n_stdlib)
    per_package = -(-(args.code - n_stdlib) // len(stubs))
    for package in sorted(stubs):
        picked += rng.sample(stubs[package], min(per_package, len(stubs[package])))
    picked = rng.sample(picked, min(args.code, len(picked)))
    code = [{"prompt": CODE_REQUEST.format(s), "source": "code"} for s in picked]

    with Path(args.round3).open(encoding="utf-8") as f:
        unanswered = [json.loads(line) for line in f][args.answered :]
    chat_pool = [r for r in unanswered if r["source"] == "sharegpt"]
    chat = rng.sample(chat_pool, min(args.chat, len(chat_pool)))

    calibration = {r["prompt"] for r in calibration_prompts(160, n_chat_trained=1100, seed=0)}
    math = [r for r in training_prompts(0, 0, args.math, seed=args.seed) if r["prompt"] not in calibration]

    evaluation_prompts = {item.prompt for items in evaluation.values() for item in items}
    rows = [r for r in code + chat + math if r["prompt"] not in evaluation_prompts]
    print(f"{len(seen)} function stubs found; " + write_in_length_chunks(args.output, rows, args.chunk, rng))


if __name__ == "__main__":
    main()
