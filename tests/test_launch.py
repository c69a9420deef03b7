"""runtime/launch.py and runtime/fork_launch.py: one node's CPU ranks forked from the launching process get
torchrun's environment, a failed rank stops the launch with its exit code, a SIGTERM to the launcher reaches the
ranks, and `SKILL_LAUNCHER` picks the launcher. (tests/test_multirank.py runs `skill run` under both launchers,
the serve tests run their workers forked.)"""

import json
import os
import time

import pytest
import rank_probe
from skill_process import CONTEXT

from runtime.errors import UserError
from runtime.launch import LAUNCHER_ENV, launch_ranks


def in_own_process(target, *args) -> int:
    """Runs rank_probe's `target` in a process forked from the suite's preloaded server; its exit code."""
    process = CONTEXT.Process(target=target, args=args)
    process.start()
    process.join(60)
    assert process.exitcode is not None, "the launch did not end"
    return process.exitcode


def launch(world_size: int, tmp_path, action: str, **env: str) -> int:
    return in_own_process(
        rank_probe.launch, world_size, [str(tmp_path), action], env, str(tmp_path / "stderr")
    )


def ranks_seen(tmp_path, world_size: int) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_forked_ranks_get_torchruns_environment(tmp_path):
    assert launch(3, tmp_path, "ok") == 0
    seen = ranks_seen(tmp_path, 3)
    assert [(s["RANK"], s["LOCAL_RANK"]) for s in seen] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in seen} == {
        ("3", "3", "127.0.0.1")
    }
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert {(s["OMP_NUM_THREADS"], s["threads"], s["argv0"]) for s in seen} == {("1", 1, "rank_probe")}


def test_threads_named_by_the_user_are_kept(tmp_path):
    assert launch(2, tmp_path, "ok", OMP_NUM_THREADS="2") == 0
    assert {s["OMP_NUM_THREADS"] for s in ranks_seen(tmp_path, 2)} == {"2"}


def test_a_failed_rank_stops_the_others_and_gives_its_code(tmp_path):
    start = time.monotonic()
    assert launch(3, tmp_path, "fail") == 3
    assert time.monotonic() - start < 30  # the waiting ranks (120 s) were stopped


def test_a_rank_exiting_with_a_message_prints_it(tmp_path):
    assert launch(2, tmp_path, "say") == 1
    assert (
        "says no" in (tmp_path / "stderr").read_text()
    )  # the first to leave; the other may be stopped first


def test_an_unknown_launcher_is_named(monkeypatch):
    monkeypatch.setenv(LAUNCHER_ENV, "mpirun")
    with pytest.raises(
        UserError, match="SKILL_LAUNCHER='mpirun' is not a launcher; use one of fork, torchrun"
    ):
        launch_ranks(2, "rank_probe", [])


def deferred(tmp_path, action: str, then: str) -> int:
    stderr = str(tmp_path / "stderr")
    return in_own_process(rank_probe.deferred, 2, [str(tmp_path), action], {}, stderr, then)


def test_deferred_ranks_start_in_a_session_of_their_own(tmp_path):
    assert deferred(tmp_path, "ok", "start") == 0
    seen = ranks_seen(tmp_path, 2)
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert len({s["sid"] for s in seen}) == 1 and seen[0]["sid"] != os.getsid(0)


def test_deferred_ranks_closed_unstarted_start_nothing(tmp_path):
    assert deferred(tmp_path, "ok", "close") == 0
    assert not list(tmp_path.glob("rank*.json"))


def test_a_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    start = time.monotonic()
    assert deferred(tmp_path, "sleep", "terminate") == 128 + 15
    assert time.monotonic() - start < 30
    for rank in ranks_seen(tmp_path, 2):
        with pytest.raises(ProcessLookupError):
            os.kill(rank["pid"], 0)
