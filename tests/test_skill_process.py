"""scripts/skill_process.py: a forked `skill` command answers as `python -m skills.cli` does."""

import subprocess

import pytest
from skill_process import Started, fresh, skill


def test_output_and_exit_codes_equal_a_fresh_interpreters(tmp_path):
    for args in (
        ["migrate", "--list-rules"],
        ["migrate", str(tmp_path / "missing"), "-o", str(tmp_path / "out")],
    ):
        forked, started = skill(*args), fresh(*args)
        assert (forked.returncode, forked.stdout) == (started.returncode, started.stdout)
        assert forked.stderr.splitlines()[-1:] == started.stderr.splitlines()[-1:]
    assert skill("migrate", tmp_path / "missing", "-o", tmp_path / "out").returncode == 1


def test_stdin_environment_and_directory_are_the_commands(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    prompt = "deployment mode: hybrid"
    forked = skill("migrate", tiny_llama_dir, "-o", out, "--dispatch-prompt", "-", input=prompt, cwd=tmp_path)
    assert forked.returncode != 0 and "hybrid" in forked.stderr, forked.stderr
    assert forked.stderr.splitlines()[-1:] == fresh(*forked.args[3:], input=prompt).stderr.splitlines()[-1:]
    assert not out.exists()


def test_a_command_past_its_timeout_is_killed_and_reported():
    with pytest.raises(subprocess.TimeoutExpired) as e:
        skill("migrate", "--list-rules", timeout=1e-3)
    assert e.value.cmd[3:] == ["migrate", "--list-rules"]


def test_a_started_command_writes_its_streams_to_the_log(tmp_path):
    """(serve tests stop their servers with SIGTERM through Started.send_signal and wait for exit code 0)"""
    log = tmp_path / "log"
    started = Started("migrate", "--list-rules", log=log)
    assert started.wait(120) == 0 == started.poll()
    assert "MG001" in log.read_text()
    failed = Started("migrate", tmp_path / "missing", "-o", tmp_path / "out", log=log)
    assert failed.wait(120) == 1 and "error:" in log.read_text() and "MG001" not in log.read_text()
