"""The flag types the commands share: `PATH[:SCALE]` for every command that takes adapters with scales."""

from __future__ import annotations

import argparse

import pytest

from gateway.cli import build_parser
from gateway.cli.flags import lora_spec


def test_a_scale_is_the_numeric_last_part_and_one_by_default() -> None:
    assert lora_spec("a.gguf") == ("a.gguf", 1.0)
    assert lora_spec("a.gguf:0.5") == ("a.gguf", 0.5)
    assert lora_spec("dir:with:colons/a.gguf:-1") == ("dir:with:colons/a.gguf", -1.0)
    assert lora_spec("s3:bucket/a.gguf") == ("s3:bucket/a.gguf", 1.0)  # not a number: part of the path
    assert lora_spec("a.gguf:0") == ("a.gguf", 0.0)


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "NaN"])
def test_a_scale_that_is_not_finite_is_refused(scale) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="adapter scale must be a finite number"):
        lora_spec(f"a.gguf:{scale}")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["export-lora", "-m", "b.gguf", "-o", "o.gguf"]])
def test_every_command_taking_path_scale_refuses_a_non_finite_scale(command, capsys) -> None:
    parser = build_parser()
    assert parser.parse_args([*command, "--lora", "a.gguf:2"]).lora == [("a.gguf", 2.0)]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*command, "--lora", "a.gguf:inf"])
    assert exit_info.value.code == 2 and "adapter scale must be a finite number" in capsys.readouterr().err
