"""runtime/launch.py and runtime/fork_launch.py: one node's CPU ranks forked from the launching process get
torchrun's environment, a failed rank stops the launch with its exit code, a SIGTERM to the launcher reaches the
ranks, and `SKILL_LAUNCHER` picks the launcher. (tests/test_multirank.py runs `skill run` under both launchers;
tests/test_serve.py checks a server's forked workers leave with it.)"""

import json
import signal
import time

import pytest
import rank_probe
from skill_process import CONTEXT, process_gone

from runtime.errors import UserError
from runtime.launch import LAUNCHER_ENV, launch_ranks


def in_own_process(target, *args) -> int:
    """Runs rank_probe's `target` in a process forked from the suite's preloaded server; its exit code."""
    process = CONTEXT.Process(target=target, args=args)
    process.start()
    process.join(60)
    if process.exitcode is None:
        process.kill()
        pytest.fail("the launch did not end in 60 s")
    return process.exitcode


def launch(world_size: int, tmp_path, action: str, **env: str) -> int:
    return in_own_process(rank_probe.launch, world_size, [str(tmp_path), action], env)


def seen(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def ranks_seen(tmp_path, world_size: int) -> list[dict]:
    return [seen(tmp_path, f"rank{r}") for r in range(world_size)]


def test_forked_ranks_get_torchruns_environment(tmp_path):
    assert launch(3, tmp_path, "ok") == 0
    ranks = ranks_seen(tmp_path, 3)
    assert [(s["RANK"], s["LOCAL_RANK"]) for s in ranks] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"]) for s in ranks} == {
        ("3", "3", "127.0.0.1")
    }
    assert len({s["MASTER_PORT"] for s in ranks}) == 1
    assert {(s["OMP_NUM_THREADS"], s["threads"], s["argv0"]) for s in ranks} == {("1", 1, "rank_probe")}


def test_threads_named_by_the_user_or_of_a_single_rank_are_kept(tmp_path):
    for name in ("named", "one"):
        (tmp_path / name).mkdir()
    assert launch(2, tmp_path / "named", "ok", OMP_NUM_THREADS="2") == 0
    assert {s["OMP_NUM_THREADS"] for s in ranks_seen(tmp_path / "named", 2)} == {"2"}
    assert launch(1, tmp_path / "one", "ok") == 0
    (one,) = ranks_seen(tmp_path / "one", 1)
    assert one["OMP_NUM_THREADS"] is None and one["threads"] == seen(tmp_path / "one", "launcher")["threads"]


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
    return in_own_process(rank_probe.deferred, 2, [str(tmp_path), action], then)


def test_deferred_ranks_start_in_a_session_of_their_own_without_the_callers_held_sockets(tmp_path):
    assert deferred(tmp_path, "ok", "start") == 0
    ranks, launcher = ranks_seen(tmp_path, 2), seen(tmp_path, "deferred")
    assert [s["RANK"] for s in ranks] == ["0", "1"]
    assert {s["sid"] for s in ranks} == {launcher["pid"]}
    for rank in ranks:
        assert launcher["kept"] in rank["sockets"] and launcher["held"] not in rank["sockets"]


@pytest.mark.parametrize("then", ["close", "exit"])
def test_deferred_ranks_left_unstarted_start_nothing_and_leave(tmp_path, then):
    assert deferred(tmp_path, "ok", then) == 0
    launcher = seen(tmp_path, "deferred")["pid"]
    deadline = time.monotonic() + 10
    while not process_gone(launcher):
        assert time.monotonic() < deadline, "the launcher outlived its caller"
        time.sleep(0.05)
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.parametrize("then,sig", [("terminate", signal.SIGTERM), ("kill", signal.SIGKILL)])
def test_a_stopped_launcher_takes_its_ranks_with_it(tmp_path, then, sig):
    start = time.monotonic()
    assert deferred(tmp_path, "sleep", then) == 128 + sig
    assert time.monotonic() - start < 30  # not the ranks' 120 s
    deadline = time.monotonic() + 10
    while not all(process_gone(rank["pid"]) for rank in ranks_seen(tmp_path, 2)):
        assert time.monotonic() < deadline, "a rank outlived its launcher"
        time.sleep(0.05)
