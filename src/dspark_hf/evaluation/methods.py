"""The methods an evaluation times besides the drafts: the baselines' names, and how tables label them."""

from __future__ import annotations

#: Plain `generate()` on the stock kernels: what a user of plain `generate()` gets; `speedup` is over it.
PLAIN = "plain"
PROMPT_LOOKUP = "prompt_lookup"
#: Plain `generate()` with the target's linears on packed CPU weights (`dspark_hf.kernels.packed`); with
#: `kernels="packed"` it is the same-kernels baseline, and `speedup_vs_packed` isolates what speculation adds.
PLAIN_PACKED = "plain_packed"
#: Plain `generate()` on the exact kernels: the same-kernels baseline of a `kernels="exact"` evaluation
#: (`speedup_vs_exact`), and the run speculative greedy output is identical to by construction.
PLAIN_EXACT = "plain_exact"
#: Plain `generate()` in the exact-bf16 mode (every linear on the exact bf16 GEMM): the same-kernels baseline of a
#: `kernels="exact-bf16"` evaluation, and the run its speculative greedy output is identical to by construction.
PLAIN_EXACT_BF16 = "plain_exact_bf16"
#: The baseline method that runs plain `generate()` on each kernel mode other than stock.
PLAIN_ON = {"packed": PLAIN_PACKED, "exact": PLAIN_EXACT, "exact-bf16": PLAIN_EXACT_BF16}
#: Sets with a task metric: GSM8K answer accuracy and HumanEval pass@1.
TASK_METRICS = {"gsm8k": ("gsm8k_accuracy", "accuracy"), "humaneval": ("humaneval_pass_at_1", "pass@1")}

_LABELS = {
    PLAIN: "plain",
    PROMPT_LOOKUP: "prompt lookup",
    PLAIN_PACKED: "plain (packed)",
    PLAIN_EXACT: "plain (exact kernels)",
    PLAIN_EXACT_BF16: "plain (exact-bf16 kernels)",
}


def label(method: str) -> str:
    """A method's name in tables and plots: a baseline's words, a draft's own name."""
    return _LABELS.get(method, method)
