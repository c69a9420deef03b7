"""runtime/launch.py: one node's CPU ranks forked from the launching process get torchrun's environment, and a
failed rank stops the launch with its exit code; `SKILL_LAUNCHER` picks the launcher. (tests/test_multirank.py
runs `skill run` under both launchers.)"""

import json
import time

import pytest
from skill_process import CONTEXT

from runtime.errors import UserError
from runtime.launch import LAUNCHER_ENV, launch_ranks


def launch(world_size: int, tmp_path, action: str, **env: str) -> int:
    import rank_probe

    stderr = str(tmp_path / "stderr")
    process = CONTEXT.Process(
        target=rank_probe.launch, args=(world_size, [str(tmp_path), action], env, stderr)
    )
    process.start()
    process.join(60)
    assert process.exitcode is not None, "the launch did not end"
    return process.exitcode


def test_forked_ranks_get_torchruns_environment(tmp_path):
    assert launch(3, tmp_path, "ok") == 0
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(s["RANK"], s["LOCAL_RANK"]) for s in seen] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in seen} == {
        ("3", "3", "127.0.0.1")
    }
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert {(s["OMP_NUM_THREADS"], s["threads"], s["argv0"]) for s in seen} == {("1", 1, "rank_probe")}


def test_threads_named_by_the_user_are_kept(tmp_path):
    assert launch(2, tmp_path, "ok", OMP_NUM_THREADS="2") == 0
    assert {json.loads((tmp_path / f"rank{r}.json").read_text())["OMP_NUM_THREADS"] for r in range(2)} == {
        "2"
    }


def test_a_failed_rank_stops_the_others_and_gives_its_code(tmp_path):
    start = time.monotonic()
    assert launch(3, tmp_path, "fail") == 3
    assert time.monotonic() - start < 30  # the waiting ranks (120 s) were stopped


def test_a_rank_exiting_with_a_message_prints_it(tmp_path):
    assert launch(2, tmp_path, "say") == 1
    err = (tmp_path / "stderr").read_text()
    assert "says no" in err  # the first rank to leave; the launcher may stop the other before it speaks


def test_an_unknown_launcher_is_named(monkeypatch):
    monkeypatch.setenv(LAUNCHER_ENV, "mpirun")
    with pytest.raises(
        UserError, match="SKILL_LAUNCHER='mpirun' is not a launcher; use one of fork, torchrun"
    ):
        launch_ranks(2, "rank_probe", [])
