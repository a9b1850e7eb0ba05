"""Tiny, offline fixtures for the training tests: a character-level chat tokenizer that fits the tiny targets
of `helpers.make_target` (96 ids), prompt files, and a driver for subprocess training runs."""

from __future__ import annotations

import json
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers import make_target

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "hello there",
    {"prompt": "what is two plus two?"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]},
    {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "old"},
            {"from": "human", "value": "more"},
        ]
    },
    "count to five",
    "why is the sea salty",
    "tell me a joke",
    "list three fruits",
]


def make_char_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """One token per character, plus `<|im_start|>` and the end-of-turn/EOS token `<|im_end|>`.

    Only `<|im_end|>` is special: a tiny random target emits `<|im_start|>` mid-response now and then, and it
    must survive `decode(skip_special_tokens=True)` so that regenerated text re-tokenizes to the same ids.
    """
    chars = list(" \n" + string.ascii_lowercase + string.digits + string.ascii_uppercase + string.punctuation)
    chars = chars[: vocab_size - len(SPECIALS)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    assert len(vocab) == vocab_size
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|im_start|>"))
    # WordLevel looks up whole pre-split words: split every character on its own.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.add_tokens(["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_chat_target(seed: int = 0, markov: bool = True, dtype=torch.float32):
    """A tiny Llama target whose EOS is the tokenizer's `<|im_end|>`."""
    target = make_target("llama", seed=seed, markov=markov, dtype=dtype)
    target.generation_config.eos_token_id = SPECIALS.index("<|im_end|>")
    return target


def write_prompts(path, prompts=PROMPTS) -> str:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    return str(path)


def sampling_args(output, **kw):
    """`PrepareDataArguments` for the tiny chat target: plain sampling at T = 1 (neither top-k nor top-p), on
    the CPU, without a progress bar, written to `output`; `kw` sets or overrides any other field."""
    from dspark_hf.train import PrepareDataArguments

    base = dict(
        output=str(output),
        max_new_tokens=24,
        batch_size=4,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        device="cpu",
        progress=False,
    )
    return PrepareDataArguments(**{**base, **kw})


def sampled_data(output, target, tokenizer, prompts, **kw) -> str:
    """`prepare_data` with [`sampling_args`] (`kw` overrides them) on `prompts`; returns the JSONL path."""
    from dspark_hf.train import prepare_data

    return prepare_data(sampling_args(output, **kw), target=target, tokenizer=tokenizer, prompts=prompts)
