"""`kiln serve`'s engine options, parsed, and what it says when its build's process dies (no server is started)."""

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


def test_a_model_path_is_served_under_the_models_own_name_and_its_path(tmp_path):
    from kiln.cli.serve_command import default_model_names

    parser = build_parser()
    gguf = tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert default_model_names(parser.parse_args(["serve", "--model", str(gguf)]), None) == [
        "qwen2.5-coder-1.5b-instruct-q4_k_m"]
    hf = tmp_path / "SmolLM2-360M-Instruct"
    assert default_model_names(parser.parse_args(["serve", "--model", str(hf) + "/"]), None)[0] == "SmolLM2-360M-Instruct"
    named = parser.parse_args(["serve", "--model", str(gguf), "--served-model-name", "coder"])
    assert default_model_names(named, None) == ["coder"]


def test_every_serve_option_says_what_it_does(capsys):
    """`kiln serve --help`: each option has a line of help, with its default where it has one."""
    import re

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    lines = capsys.readouterr().out.splitlines()
    bare = [line for i, line in enumerate(lines) if re.match(r"^  --?\S", line)
            and len(re.split(r"\s{2,}", line.strip(), maxsplit=1)) == 1
            and (i + 1 == len(lines) or not lines[i + 1].startswith(" " * 10) or re.match(r"^  --?\S", lines[i + 1]))]
    assert not bare, bare


def test_reasoning_parser_is_off_by_default_and_an_unknown_one_names_the_choices(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve"]).reasoning_parser is None
    assert parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--reasoning-parser", "r1"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'r1' (choose from 'deepseek_r1', 'qwen3')" in capsys.readouterr().err


def _killed(args) -> None:
    """A build whose process the system kills (as it kills one out of memory)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_build_killed_by_the_system_is_a_load_error_that_says_what_to_do():
    from kiln.cli.child_build import ChildBuild
    from kiln.runtime.errors import ModelLoadError

    with pytest.raises(ModelLoadError) as error:
        ChildBuild(_killed, None, "big.gguf")()
    assert "building big.gguf stopped: its process was killed" in str(error.value)
    assert "--bs-decode" in str(error.value) and "kiln serve --artifacts" in str(error.value)


def test_embeddings_and_pooling_reach_the_build_and_the_engine(monkeypatch, tmp_path):
    import kiln.export.build as build_module
    from kiln.cli.model_args import resolve_artifacts

    built = []
    monkeypatch.setattr(build_module, "build", lambda model, options, targets, log: built.append(options) or tmp_path)
    parser = build_parser()
    resolve_artifacts(parser.parse_args(["serve", "--embeddings"]), log=lambda line: None)
    resolve_artifacts(parser.parse_args(["serve"]), log=lambda line: None)
    assert [options.embedding_functions for options in built] == [True, False]
    assert parser.parse_args(["serve", "--pooling", "mean"]).pooling == "mean"
    assert parser.parse_args(["serve"]).pooling is None


def test_the_longest_sequence_reaches_the_build_with_a_cache_that_holds_one(monkeypatch, tmp_path):
    import kiln.export.build as build_module
    from kiln.cli.model_args import ModelChoiceError, resolve_artifacts

    built = []
    monkeypatch.setattr(build_module, "build", lambda model, options, targets, log: built.append(options) or tmp_path)
    parser = build_parser()
    for argv in (["serve"], ["serve", "--max-model-len", "2048"], ["serve", "--max-seq-len", "32768"]):
        resolve_artifacts(parser.parse_args(argv), log=lambda line: None)
    assert [(o.max_seq_len, o.device_block_count) for o in built] == [(4096, 1024), (2048, 1024), (32768, 2048)]
    for bad in ("0", "1000"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max-model-len", bad])
    with pytest.raises(ModelChoiceError, match="--max-model-len sets the length a model is built for"):
        resolve_artifacts(parser.parse_args(["serve", "--artifacts", str(tmp_path), "--max-model-len", "2048"]))


@pytest.mark.parametrize("argv,fields", [
    ([], {"page_count": 0, "memory_budget_bytes": 0, "memory_fraction": 0.0}),
    (["--kv-cache-pages", "40"], {"page_count": 40, "memory_budget_bytes": 0, "memory_fraction": 0.0}),
    (["--kv-cache-memory", "4GiB"], {"page_count": 0, "memory_budget_bytes": 4 * 2**30, "memory_fraction": 0.0}),
    (["--kv-cache-memory", "1500000"], {"page_count": 0, "memory_budget_bytes": 1500000, "memory_fraction": 0.0}),
    (["--kv-cache-memory", "0.8"], {"page_count": 0, "memory_budget_bytes": 0, "memory_fraction": 0.8}),
    (["--gpu-memory-utilization", "0.5"], {"page_count": 0, "memory_budget_bytes": 0, "memory_fraction": 0.5}),
])
def test_the_kv_cache_is_sized_by_pages_bytes_or_a_share_of_memory(argv, fields):
    from kiln.cli.serve_command import kv_cache_size
    from kiln.runtime.service_config import ServiceConfig

    assert kv_cache_size(build_parser().parse_args(["serve", *argv])) == fields
    ServiceConfig(**fields)  # accepted as they are


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-memory", "1.5"], "a fraction in (0, 1]"),
    (["--kv-cache-memory", "lots"], "expected a size such as 4GiB or a fraction"),
    (["--kv-cache-memory=-2GiB"], "must be >= 0"),
    (["--gpu-memory-utilization", "0"], "must be in (0, 1]"),
    (["--kv-cache-pages", "40", "--kv-cache-memory", "1GiB"], "not allowed with argument"),
    (["--kv-cache-memory", "0.9", "--gpu-memory-utilization", "0.9"], "not allowed with argument"),
])
def test_a_kv_cache_size_that_makes_no_sense_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_batch_invariant_and_device_sampling_reach_the_engine_and_speculation_is_refused(monkeypatch, tmp_path):
    import kiln.server.main as server_main
    from kiln.cli.serve_command import run_serve

    configs = []
    monkeypatch.setattr(server_main, "serve", lambda config, settings, **kwargs: configs.append(config) or 0)
    parser = build_parser()
    for flag in ("--batch-invariant", "--enable-deterministic-inference"):
        run_serve(parser.parse_args(["serve", flag]))
    run_serve(parser.parse_args(["serve"]))
    run_serve(parser.parse_args(["serve", "--no-device-sampling"]))
    assert [config.batch_invariant for config in configs] == [True, True, False, False]
    assert [config.device_sampling for config in configs] == [True, True, True, False]
    with pytest.raises(SystemExit, match="--speculative-model .* --batch-invariant"):
        run_serve(parser.parse_args(["serve", "--batch-invariant", "--speculative-model", "ngram"]))
