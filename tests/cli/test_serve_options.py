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
