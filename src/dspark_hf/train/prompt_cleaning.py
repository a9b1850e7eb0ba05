"""Cleaning training prompts: exact duplicates, degenerate prompts, and reference texts kept out.

- [`dedupe_prompts`]: exact match after [`normalise_prompt`] (NFKC, case-folded, letters and digits only);
- [`filter_prompts`] with a [`PromptFilter`]: too short or long, repetitive, mostly non-ASCII;
- [`NearDuplicateIndex`] / [`exclude_near_duplicates`]: keeps reference texts (the evaluation sets) out by exact
  match, a shared word 13-gram (as in contamination checks) and character 5-gram Jaccard similarity.

Rows are strings or dicts with a `"prompt"`; every function keeps their order. [`dspark_hf.train.prompts`] runs
each prompt it writes to a prompt file through all three.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+")


# ---------------------------------------------------------------------- normalising and deduplicating
def _words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def normalise_prompt(text: str) -> str:
    """The key two prompts are duplicates under: NFKC, case-folded, only letters and digits, single spaces.

    Prompts that differ only in punctuation, casing or spacing share a key. A text without any letter or digit
    keeps its case-folded, whitespace-collapsed self.
    """
    words = _words(text)
    return " ".join(words) if words else " ".join(text.casefold().split())


def _text(row) -> str:
    return row["prompt"] if isinstance(row, dict) else row


def _partition(rows: Iterable, why: Callable[[str], str | None]) -> tuple[list, Counter]:
    """The rows for whose text `why` gives `None`, in order, and how many each other answer of `why` rejected."""
    kept, rejected = [], Counter()
    for row in rows:
        reason = why(_text(row))
        if reason is None:
            kept.append(row)
        else:
            rejected[reason] += 1
    return kept, rejected


def dedupe_prompts(rows: Iterable, seen: set[str] | None = None) -> list:
    """`rows` (strings, or dicts with a `"prompt"`) without the ones whose [`normalise_prompt`] key came before.

    Args:
        rows: the prompts, in order (the first of each key is kept).
        seen (`set[str]`, *optional*): keys already taken (e.g. a file's rows); updated in place.
    """
    seen = set() if seen is None else seen
    out = []
    for row in rows:
        key = normalise_prompt(_text(row))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


# ---------------------------------------------------------------------- degenerate prompts
@dataclass
class PromptFilter:
    """What [`filter_prompts`] rejects. A prompt is kept when none of these holds.

    Args:
        min_chars, max_chars (`int`): its length after stripping, in characters.
        min_words (`int`): fewer words (letters or digits) than this.
        max_non_ascii (`float`): more than this fraction of non-ASCII characters (the default target is English).
        min_distinct_trigrams (`float`): repetitive: in a prompt of at least 12 words, fewer distinct word
            trigrams than this fraction of its trigrams (a loop of the same phrase).
        max_line_repeats (`int`): repetitive: the same non-empty line more often than this.
        max_char_run (`int`): repetitive: one character more often than this in a row.
    """

    min_chars: int = 16
    max_chars: int = 2000
    min_words: int = 3
    max_non_ascii: float = 0.05
    min_distinct_trigrams: float = 0.5
    max_line_repeats: int = 4
    max_char_run: int = 40

    def reason(self, text: str) -> str | None:
        """Why `text` is rejected (`"too_short"`, `"too_long"`, `"non_ascii"`, `"repetitive"`), or `None`."""
        text = text.strip()
        words = _words(text)
        if len(text) < self.min_chars or len(words) < self.min_words:
            return "too_short"
        if len(text) > self.max_chars:
            return "too_long"
        if sum(not c.isascii() for c in text) > self.max_non_ascii * len(text):
            return "non_ascii"
        if len(words) >= 12:
            trigrams = list(zip(words, words[1:], words[2:]))
            if len(set(trigrams)) < self.min_distinct_trigrams * len(trigrams):
                return "repetitive"
        lines = Counter(line.strip() for line in text.splitlines() if line.strip())
        if lines and max(lines.values()) > self.max_line_repeats:
            return "repetitive"
        if re.search(rf"(.)\1{{{self.max_char_run},}}", text):
            return "repetitive"
        return None


def filter_prompts(rows: Iterable, prompt_filter: PromptFilter | None = None) -> tuple[list, Counter]:
    """The rows (strings, or dicts with a `"prompt"`) that pass `prompt_filter`, and how many each reason rejected.

    Returns:
        `tuple[list, Counter]`: the kept rows, in order, and `{reason: count}` of the rejected ones.
    """
    return _partition(rows, (prompt_filter or PromptFilter()).reason)


# ---------------------------------------------------------------------- keeping reference texts out
class NearDuplicateIndex:
    """Reference texts (e.g. every evaluation prompt) that a training prompt must not match, nearly or exactly.

    A text matches when, after [`normalise_prompt`] (so punctuation, casing and spacing never matter):

    - `"exact"`: it equals a reference;
    - `"ngram"`: it shares a word `ngram`-gram (13 by default, as in contamination checks) with a reference whose
      words are mostly the reference's own: a word counts as boilerplate when it lies in a `template_ngram`-gram
      (8 words) that `template_df` or more references share (an instruction wrapper such as the evaluation's
      "Complete this Python function …" or "Answer step by step, then give the final number."), and an n-gram
      needs more than half of its words outside boilerplate;
    - `"jaccard"`: the Jaccard similarity of its character `char_ngram`-gram sets and a reference's is at least
      `jaccard` (a lightly edited reference: a word changed, added or dropped).

    The Jaccard test is exact, not sampled: candidate references come from an inverted index of the rarer
    shingles, and a reference whose common shingles alone could reach the threshold is always compared.
    """

    def __init__(
        self,
        reference_texts: Iterable[str],
        *,
        ngram: int = 13,
        char_ngram: int = 5,
        jaccard: float = 0.5,
        template_df: int = 5,
        template_ngram: int = 8,
        rare_df: int = 16,
    ) -> None:
        if not 0.0 < jaccard <= 1.0:
            raise ValueError(f"jaccard must be in (0, 1], got {jaccard}.")
        self.ngram, self.char_ngram, self.jaccard = ngram, char_ngram, jaccard
        keys = list(dict.fromkeys(normalise_prompt(t) for t in reference_texts))
        self.references = keys
        self.exact = set(keys)
        self.ngrams = self._content_ngrams(keys, template_ngram, template_df)
        self.shingles = [self._shingles(k) for k in keys]
        shingle_df: Counter = Counter()
        for s in self.shingles:
            shingle_df.update(s)
        self.index: dict[str, list[int]] = {}
        self.always: list[int] = []
        for i, s in enumerate(self.shingles):
            common = sum(shingle_df[x] > rare_df for x in s)
            if common >= jaccard * len(s):
                self.always.append(i)
            for x in s:
                if shingle_df[x] <= rare_df:
                    self.index.setdefault(x, []).append(i)

    def _content_ngrams(self, keys: list[str], template_ngram: int, template_df: int) -> set[tuple[str, ...]]:
        """The references' `ngram`-grams with more than half of their words outside boilerplate."""
        words = [k.split() for k in keys]
        df: Counter = Counter()
        for w in words:
            df.update({tuple(w[i : i + template_ngram]) for i in range(len(w) - template_ngram + 1)})
        out = set()
        for w in words:
            covered = [False] * len(w)
            for i in range(len(w) - template_ngram + 1):
                if df[tuple(w[i : i + template_ngram])] >= template_df:
                    covered[i : i + template_ngram] = [True] * template_ngram
            for i in range(len(w) - self.ngram + 1):
                if 2 * (self.ngram - sum(covered[i : i + self.ngram])) > self.ngram:
                    out.add(tuple(w[i : i + self.ngram]))
        return out

    def _ngrams(self, key: str) -> set[tuple[str, ...]]:
        words = key.split()
        return {tuple(words[i : i + self.ngram]) for i in range(len(words) - self.ngram + 1)}

    def _shingles(self, key: str) -> set[str]:
        n = self.char_ngram
        return {key[i : i + n] for i in range(max(1, len(key) - n + 1))}

    def match(self, text: str) -> tuple[str, str] | None:
        """`(kind, reference)` of the first match of `text` (kind `"exact"`, `"ngram"` or `"jaccard"`), or `None`."""
        key = normalise_prompt(text)
        if key in self.exact:
            return "exact", key
        if self.ngrams:
            for gram in self._ngrams(key):
                if gram in self.ngrams:
                    return "ngram", " ".join(gram)
        shingles = self._shingles(key)
        candidates = set(self.always)
        for x in shingles:
            candidates.update(self.index.get(x, ()))
        low, high = self.jaccard * len(shingles), len(shingles) / self.jaccard
        for i in sorted(candidates):
            ref = self.shingles[i]
            if not low <= len(ref) <= high:  # J(A, B) <= min(|A|, |B|) / max(|A|, |B|)
                continue
            shared = len(shingles & ref)
            if shared and shared >= self.jaccard * (len(shingles) + len(ref) - shared):
                return "jaccard", self.references[i]
        return None


def exclude_near_duplicates(
    rows: Iterable, reference_texts: Iterable[str] | NearDuplicateIndex, **index_kwargs
) -> tuple[list, Counter]:
    """The rows (strings, or dicts with a `"prompt"`) that match no reference text (see [`NearDuplicateIndex`]).

    Args:
        rows: the prompts.
        reference_texts (`Iterable[str]` or [`NearDuplicateIndex`]): the texts to keep out, or an index of them
            (build one index and reuse it for many calls).
        index_kwargs: [`NearDuplicateIndex`]'s thresholds, when `reference_texts` are texts.

    Returns:
        `tuple[list, Counter]`: the kept rows and `{kind: count}` of the excluded ones.
    """
    index = (
        reference_texts
        if isinstance(reference_texts, NearDuplicateIndex)
        else NearDuplicateIndex(reference_texts, **index_kwargs)
    )

    def kind(text: str) -> str | None:
        hit = index.match(text)
        return None if hit is None else hit[0]

    return _partition(rows, kind)
