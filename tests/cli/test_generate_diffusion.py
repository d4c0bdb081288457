"""`kiln generate` on a diffusion LM, with its flags, and the one-line refusal on an autoregressive model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_kiln

pytestmark = pytest.mark.e2e


def test_generate_with_diffusion_flags(tiny_llada_artifacts):
    done = run_kiln("generate", "--artifacts", str(tiny_llada_artifacts), "--prompt", "Once upon a time",
                    "--max-tokens", "16", "--block-length", "8", "--threshold", "0.5", "--cache", "dual",
                    "--ignore-eos", "--json")
    [completion] = json.loads(done.stdout)["completions"]
    assert len(completion["token_ids"]) == 16 and completion["finish_reason"] == "length"


def test_an_autoregressive_model_refuses_them_in_one_line(tiny_artifacts):
    done = run_kiln("generate", "--artifacts", str(tiny_artifacts), "--prompt", "Hello", "--steps", "8", check=False)
    assert done.returncode != 0
    assert "steps applies only to diffusion models; this model is autoregressive" in done.stderr
    assert "Traceback" not in done.stderr
