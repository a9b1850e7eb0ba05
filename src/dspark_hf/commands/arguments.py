"""The command-line flags the `dspark` commands share, written once (TRL's shared argument dataclasses).

`dspark generate`, `dspark eval` and `dspark serve` take the same `--policy`, `--lookup`, `--cuda-graphs`,
`--compiled` and `--kernels` flags: [`add_speculation_arguments`] builds them from the fields of
[`SpeculationArguments`], each with its one help text. The same commands (and `dspark demo`) take `--target`,
`--dtype`, `--device` and `--threads` from [`ModelArguments`]. Their values are the *call* level of
`dspark_hf.decoding.options.resolve_options`: a flag left out (or given its `default` / `auto` word) is unset,
so the draft's own defaults (its `generation_config.json`) decide, then the library's, as in `generate()` and
the engine.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ._common import UserError

#: A switch flag's words and the option values they stand for; its "unset" word (`default`, `auto`) is `None`.
SWITCH = {"on": True, "off": False}

_POLICY_HELP = (
    "verification policy: fixed, fixed:N, adaptive[:N] (N drafts while that measurably pays), threshold:T "
    "(survival rule), confidence_threshold:T (DeepSpec's rule), hardware_aware[:BG], hardware_aware_lagged[:BG] "
    "or hardware_aware_uniform[:BG]; 'none' (dspark serve) serves without speculation; 'default' is the same as "
    "no flag (default: the draft's own, from its generation_config.json, else the library's: "
    "hardware_aware_uniform for a calibrated draft, else fixed)"
)
_LOOKUP_HELP = (
    "prompt lookup before drafting: on (a recurring continuation of the context is copied and verified instead "
    "of a draft; exact, and a measured gate stops it where it does not pay), off, or default (the draft's own "
    "setting, else off)"
)
_GRAPHS_HELP = "the draft step as a captured CUDA graph: on, off or auto (on for a CUDA draft)"
_COMPILED_HELP = (
    "the drafting round as compiled calls where that backend is eligible (the exact CPU kernels): on, off or auto (on)"
)
_KERNELS_HELP = (
    "CPU kernels of every forward of the run: exact (batch-invariant: a sequence's tokens do not depend on the "
    "others decoded with it, so speculative greedy output equals plain decoding on them by construction), stock "
    "(PyTorch's own), packed, or exact-bf16 (exact with every linear on a bf16 GEMM: batch-invariant, but not "
    "float32 output) (default: exact for a float32 Llama/Qwen target on the CPU, stock elsewhere; see "
    "docs/cpu-packing.md)"
)


@dataclass
class SpeculationArguments:
    """The speculation options of a `dspark` command, one field per option of
    [`SpeculationOptions`][dspark_hf.decoding.options.SpeculationOptions] (the field's metadata holds its flag's
    help, choices, unset word and, for `dspark eval`, how a method named after a value reads).

    Args:
        policy (`str`, *optional*): a verification policy string (`"default"`: unset).
        cuda_graphs (`str`, *optional*): `"on"`, `"off"` or `"auto"` (unset).
        lookup (`str`, *optional*): `"on"`, `"off"` or `"default"` (unset).
        compiled (`str`, *optional*): `"on"`, `"off"` or `"auto"` (unset).
        kernels (`str`, *optional*): `"stock"`, `"packed"`, `"exact"` or `"exact-bf16"`.
    """

    policy: str | None = field(
        default=None, metadata={"help": _POLICY_HELP, "metavar": "POLICY", "unset": "default", "method": "{}"}
    )
    cuda_graphs: str | None = field(
        default=None,
        metadata={"help": _GRAPHS_HELP, "choices": ("auto", "on", "off"), "unset": "auto", "method": "graphs-{}"},
    )
    lookup: str | None = field(
        default=None,
        metadata={
            "help": _LOOKUP_HELP,
            "choices": ("default", "on", "off"),
            "unset": "default",
            "method": "lookup-{}",
        },
    )
    compiled: str | None = field(
        default=None,
        metadata={"help": _COMPILED_HELP, "choices": ("auto", "on", "off"), "unset": "auto", "method": "compiled-{}"},
    )
    # dspark_hf.kernels.KERNEL_MODES, spelled out so that building the parser imports no torch (tested equal)
    kernels: str | None = field(
        default=None, metadata={"help": _KERNELS_HELP, "choices": ("stock", "packed", "exact", "exact-bf16")}
    )

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> SpeculationArguments:
        """The flags of a parsed command line (one value each; see [`speculation_variants`] for lists)."""
        return cls(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    def call(self) -> dict[str, Any]:
        """The call level of `resolve_options`, by option name: `None` for a flag not given or given its unset
        word, `True`/`False` for a switch's `on`/`off`, the string itself otherwise."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value == f.metadata.get("unset"):
                value = None
            elif "on" in f.metadata.get("choices", ()):
                value = SWITCH.get(value, value)
            values[f.name] = value
        return values

    def flags(self) -> str:
        """The flags given, as typed (`--policy fixed --lookup on`), for a message about them."""
        given = [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]
        return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in given) or "the draft's defaults"

    def check(self) -> None:
        """Check what can be checked before a model is loaded (a policy's spelling), so a typo costs no load time.

        Raises:
            `UserError`: naming the flag. Whether the draft can run a policy (its confidence head) is known only
            once it is loaded: [`resolve`] says so then.
        """
        if self.policy in (None, "default", "none"):
            return
        from ..scheduling.policies import resolve_policy

        try:
            resolve_policy(self.policy)
        except ValueError as err:
            raise UserError(f"--policy: {err}") from None

    def resolve(self, draft, target):
        """`resolve_options(draft, target, call=self.call())`, a bad value a [`UserError`] naming the flags.

        Returns:
            [`SpeculationOptions`][dspark_hf.decoding.options.SpeculationOptions]
        """
        from ..decoding.options import resolve_options

        try:
            return resolve_options(draft, target, call=self.call())
        except (ValueError, TypeError) as err:
            raise UserError(f"{self.flags()}: {err}") from None


def add_speculation_arguments(
    parser: argparse.ArgumentParser, *, several: bool = False, defaults: Mapping[str, Any] | None = None
) -> None:
    """Add the flags of [`SpeculationArguments`] to `parser`, in a group of their own.

    Args:
        parser (`argparse.ArgumentParser`): a command's parser.
        several (`bool`, *optional*, defaults to `False`): every flag but `--kernels` takes one or more values
            (`dspark eval`: each draft runs under each, see [`speculation_variants`]).
        defaults (`Mapping[str, Any]`, *optional*): a default per field name (`dspark serve` reads its
            environment variables); unset by default.
    """
    group = parser.add_argument_group(
        "speculation options",
        "the call level of the options' one precedence: a flag left out leaves the option to the draft's own "
        "defaults (its generation_config.json), then the library's",
    )
    for f in fields(SpeculationArguments):
        meta = f.metadata
        kwargs: dict[str, Any] = {key: meta[key] for key in ("choices", "metavar") if key in meta}
        kwargs.update(default=(defaults or {}).get(f.name), help=meta["help"])
        if several and "method" in meta:
            method = "NAME@" + meta["method"].format(meta.get("metavar", "VALUE"))
            kwargs.update(nargs="+", help=f"{meta['help']}. Several values run each draft under each, as {method}")
        group.add_argument(f"--{f.name.replace('_', '-')}", **kwargs)


def speculation_variants(args: argparse.Namespace) -> dict[str, SpeculationArguments]:
    """Every combination of the values of flags added with `several=True`, by its method suffix.

    A flag with one value (or none) is the same in every variant and names none; the suffix joins the values of
    the flags given several, e.g. `{"fixed@lookup-on": ..., "fixed@lookup-off": ...}` for `--policy fixed --lookup
    on off`, and `{"": ...}` when no flag varies.
    """
    axes = []
    for f in fields(SpeculationArguments):
        values = getattr(args, f.name, None)
        values = values if isinstance(values, list) else [values]
        axes.append([(f, value) for value in dict.fromkeys(values)])
    variants = {}
    for combination in itertools.product(*axes):
        parts = [f.metadata["method"].format(value) for (f, value), axis in zip(combination, axes) if len(axis) > 1]
        variants["@".join(parts)] = replace(SpeculationArguments(), **{f.name: value for f, value in combination})
    return variants


def share_speculation_help(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """Give flags that another dataclass defines (`dspark prepare-data`'s `--kernels`, a field of
    `PrepareDataArguments`, which its YAML configs also set) the help and choices of [`SpeculationArguments`]'
    field of the same name, so that each flag is described once."""
    by_name = {f.name: f.metadata for f in fields(SpeculationArguments)}
    for action in parser._actions:
        if action.dest in names:
            action.help, action.choices = by_name[action.dest]["help"], by_name[action.dest].get("choices")


@dataclass
class ModelArguments:
    """Where a command's models come from and run (the draft flag differs per command and stays with it).

    Args:
        target (`str`, *optional*): the target's folder or Hub id (default: the offline SmolLM2-135M-Instruct).
        dtype (`str`, *optional*): the target's dtype; the draft follows it.
        device (`str`, *optional*): where target and draft run.
        threads (`int`, *optional*): torch's CPU threads.
    """

    target: str | None = field(
        default=None, metadata={"help": "target model folder or Hub id (default: SmolLM2-135M-Instruct, offline)"}
    )
    dtype: str | None = field(
        default=None, metadata={"help": "target dtype, the draft's follows: float32 (default), bfloat16 or float16"}
    )
    device: str | None = field(default=None, metadata={"help": "where target and draft run, e.g. cuda (default: cpu)"})
    threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (default: torch's choice)", "type": int}
    )


def add_model_arguments(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...] = ("target", "dtype", "device", "threads"),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of [`ModelArguments`] named in `names` to `parser` (`defaults`: one per field name, e.g. the
    environment variables of `dspark serve`)."""
    for f in fields(ModelArguments):
        if f.name in names:
            kwargs = {key: f.metadata[key] for key in ("type",) if key in f.metadata}
            parser.add_argument(f"--{f.name}", default=(defaults or {}).get(f.name), help=f.metadata["help"], **kwargs)
