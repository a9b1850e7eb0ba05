"""The speculation flags of `dspark generate`, `eval`, `serve` (and `prepare-data`'s `--kernels`) are written once, in
`SpeculationArguments`, and reach `resolve_options` as its call level."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch

from dspark_hf.cli import build_parser
from dspark_hf.commands._common import UserError
from dspark_hf.commands.arguments import (
    ModelArguments,
    SpeculationArguments,
    add_speculation_arguments,
    speculation_variants,
)
from train_helpers import make_chat_target

from helpers import make_aligned_draft

FLAGS = {f"--{f.name.replace('_', '-')}": f.metadata["help"] for f in fields(SpeculationArguments)}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {flag: action.help for action in parser._actions for flag in action.option_strings if flag in FLAGS}


@pytest.mark.parametrize("command", ["generate", "eval", "serve"])
def test_every_speculative_command_takes_the_same_flags_with_one_help(command):
    helps = _helps(_subparser(command))
    assert set(helps) == set(FLAGS)
    for flag, text in helps.items():
        assert text.startswith(FLAGS[flag]), (command, flag)  # eval adds how several values name its methods


def test_kernel_choices_are_the_kernel_modes():
    from dspark_hf.kernels import KERNEL_MODES

    kernels = next(f for f in fields(SpeculationArguments) if f.name == "kernels")
    assert tuple(kernels.metadata["choices"]) == tuple(KERNEL_MODES)


def test_prepare_data_kernels_reads_as_the_others():
    assert _helps(_subparser("prepare-data"))["--kernels"] == FLAGS["--kernels"]
    assert _subparser("prepare-data").parse_args(["--kernels", "exact"]).kernels == "exact"
    with pytest.raises(SystemExit):
        _subparser("prepare-data").parse_args(["--kernels", "fast"])


def test_flags_become_the_call_level():
    args = _subparser("generate").parse_args(["--policy", "fixed:3", "--lookup", "off", "--cuda-graphs", "on"])
    call = SpeculationArguments.from_namespace(args).call()
    assert call == {"policy": "fixed:3", "cuda_graphs": True, "lookup": False, "compiled": None, "kernels": None}
    unset = ["--policy", "default", "--lookup", "default", "--cuda-graphs", "auto", "--compiled", "auto"]
    assert set(SpeculationArguments.from_namespace(_subparser("generate").parse_args(unset)).call().values()) == {None}


def test_eval_runs_each_draft_under_each_value():
    parser = argparse.ArgumentParser()
    add_speculation_arguments(parser, several=True)
    variants = speculation_variants(parser.parse_args(["--policy", "default", "fixed", "--lookup", "on", "off"]))
    assert list(variants) == ["default@lookup-on", "default@lookup-off", "fixed@lookup-on", "fixed@lookup-off"]
    assert variants["fixed@lookup-off"].call()["policy"] == "fixed" and variants["default@lookup-on"].call() == {
        "policy": None, "cuda_graphs": None, "lookup": True, "compiled": None, "kernels": None,
    }  # fmt: skip
    assert list(speculation_variants(parser.parse_args(["--policy", "fixed"]))) == [""]  # one value: no suffix


def test_a_flag_wins_over_the_drafts_default_and_an_unset_one_leaves_it():
    """Through the CLI's door the precedence is the resolver's: the flag, else the draft's generation config."""
    target = make_chat_target(dtype=torch.float64)
    draft = make_aligned_draft(target, block_size=4)
    draft.generation_config.dspark_policy = "fixed:2"
    assert SpeculationArguments(policy="fixed:3").resolve(draft, target).policy.n == 3
    assert SpeculationArguments().resolve(draft, target).policy.n == 2
    assert SpeculationArguments(policy="default").resolve(draft, target).policy.n == 2  # the word for unset
    with pytest.raises(UserError, match="--policy nonsense: .*Unknown verification policy"):
        SpeculationArguments(policy="nonsense").resolve(draft, target)
    with pytest.raises(UserError, match="--policy: Unknown verification policy 'nonsense'"):
        SpeculationArguments(policy="nonsense").check()  # before any model is loaded


@pytest.mark.parametrize("command", ["generate", "eval", "serve", "demo"])
def test_the_model_flags_are_written_once_too(command):
    helps = {f"--{f.name}": f.metadata["help"] for f in fields(ModelArguments)}
    given = {flag: a.help for a in _subparser(command)._actions for flag in a.option_strings if flag in helps}
    assert given == {flag: helps[flag] for flag in given} and "--target" in given and "--threads" in given
