"""`kiln serve`'s engine options, parsed (no server is started)."""

from __future__ import annotations

import pytest

from kiln.cli.main import build_parser


def test_max_prefill_tokens_defaults_to_512_and_rejects_negatives(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_prefill_tokens == 512
    assert parser.parse_args(["serve", "--max-prefill-tokens", "0"]).max_prefill_tokens == 0
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--max-prefill-tokens", "-1"])
    assert exit_info.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_parameter_memory_defaults_to_auto_and_takes_only_its_choices(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve"]).parameter_memory == "auto"
    assert parser.parse_args(["generate", "--prompt", "hi", "--parameter-memory", "mapped"]).parameter_memory == "mapped"
    assert parser.parse_args(["serve", "--parameter-memory", "private"]).parameter_memory == "private"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--parameter-memory", "huge"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err
