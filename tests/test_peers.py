"""`benchmarks/peers.py`'s `run_tool`: a llama.cpp tool that crashes on its default run is run again with its
repack off, and the command is recorded; one that runs is run once. The tools here are real processes (shell
scripts) that die by SIGSEGV as llama.cpp's AMX-repacked runs did."""

import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers  # noqa: E402


def _tool(folder: Path, body: str) -> str:
    path = folder / "llama-tool"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls'}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch):
    monkeypatch.setattr(peers, "repack_off", [])


def test_a_crashed_run_is_run_again_without_the_repack(tmp_path):
    tool = _tool(tmp_path, 'case "$*" in *--no-repack*) echo table; echo note >&2;; *) kill -SEGV $$;; esac')
    assert peers.run_tool([tool, "-m", "x.gguf"], peers.BATCHED_NO_REPACK) == "table\n"
    assert peers.run_tool([tool, "-m", "x.gguf"], peers.BATCHED_NO_REPACK, with_stderr=True) == "table\nnote\n"
    assert peers.repack_off == ["llama-tool -m x.gguf --no-repack"] * 2
    assert (tmp_path / "calls").read_text().splitlines() == ["-m x.gguf", "-m x.gguf --no-repack"] * 2


def test_a_run_that_works_runs_once_and_a_second_crash_raises(tmp_path):
    tool = _tool(tmp_path, "echo fine")
    assert peers.run_tool([tool, "-p", "0"], peers.BENCH_NO_REPACK) == "fine\n"
    assert peers.repack_off == [] and (tmp_path / "calls").read_text() == "-p 0\n"
    broken = _tool(tmp_path, "kill -SEGV $$")
    with pytest.raises(subprocess.CalledProcessError):
        peers.run_tool([broken, "-p", "0"], peers.BENCH_NO_REPACK)
