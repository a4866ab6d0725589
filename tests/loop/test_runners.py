"""Runners: real harness processes and real runner worker processes, on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agl import semconv
from agl_trainer.runners.base import Cause, Endpoint, HarnessNotFound, RolloutSpec
from agl_trainer.runners.local import CommandRunner
from agl_trainer.runners.workers import FunctionRunner

ENDPOINT = Endpoint(sidecar_url="http://127.0.0.1:9", otlp_endpoint="http://127.0.0.1:8")


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def spec(rollout_id: str = "r1", **task: object) -> RolloutSpec:
    return RolloutSpec(rollout_id, "t1", {"id": "t1", **task})


async def test_harness_gets_its_endpoint_and_ids(tmp_path: Path) -> None:
    argv = script(
        tmp_path,
        "env",
        """
        import json, os, sys
        keys = ["OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "AGL_ROLLOUT_ID", "AGL_TASK_ID",
                "AGL_ATTEMPT", "AGL_ROLLOUT_MODE", "AGL_OTLP_ENDPOINT", "AGL_TASK", "EXTRA"]
        open(sys.argv[1], "w").write(json.dumps({k: os.environ.get(k) for k in keys}))
        print("hello from the harness")
        """,
    ) + [str(tmp_path / "env.json")]
    endpoint = Endpoint("http://127.0.0.1:7000", "http://127.0.0.1:4318", {"EXTRA": "x"})
    runner = CommandRunner(argv, endpoint, log_dir=tmp_path / "logs")
    await runner.start()
    outcome = await runner.run(spec("roll-7", key="k3"))
    assert outcome.cause is Cause.OK and outcome.exit_code == 0
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:7000/rollouts/roll-7/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:7000/rollouts/roll-7"
    assert env["OPENAI_API_KEY"]
    assert (env["AGL_ROLLOUT_ID"], env["AGL_TASK_ID"], env["AGL_ATTEMPT"]) == ("roll-7", "t1", "0")
    assert env["AGL_ROLLOUT_MODE"] == semconv.MODE_TRAIN
    assert env["AGL_OTLP_ENDPOINT"] == "http://127.0.0.1:4318"
    assert json.loads(env["AGL_TASK"]) == {"id": "t1", "key": "k3"}
    assert env["EXTRA"] == "x"
    assert "hello from the harness" in Path(outcome.log_path).read_text()


async def test_crashing_harness_is_reported_not_retried(tmp_path: Path) -> None:
    argv = script(tmp_path, "crash", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    exits = []
    runner = CommandRunner(argv, ENDPOINT, retries=2, log_dir=tmp_path, on_exit=exits.append)
    await runner.start()
    outcome = await runner.run(spec())
    assert outcome.cause is Cause.HARNESS_ERROR
    assert outcome.exit_code == 3 and outcome.attempts == 1
    assert "exited with code 3" in outcome.message
    assert "boom" in Path(outcome.log_path).read_text()
    assert [o.cause for o in exits] == [Cause.HARNESS_ERROR]


async def test_infrastructure_failures_are_retried_as_new_attempts(tmp_path: Path) -> None:
    # Exit 75 (EX_TEMPFAIL) on the first two attempts, succeed on the third.
    argv = script(
        tmp_path,
        "flaky",
        """
        import os, sys
        open(sys.argv[1], "a").write(os.environ["AGL_ATTEMPT"] + " " + os.environ["OPENAI_BASE_URL"] + "\\n")
        sys.exit(75 if int(os.environ["AGL_ATTEMPT"]) < 2 else 0)
        """,
    ) + [str(tmp_path / "attempts.txt")]
    exits = []
    runner = CommandRunner(argv, ENDPOINT, retries=2, on_exit=exits.append)
    await runner.start()
    outcome = await runner.run(spec("r9"))
    assert outcome.cause is Cause.OK and outcome.attempts == 3 and outcome.spec.attempt == 2
    lines = (tmp_path / "attempts.txt").read_text().splitlines()
    assert lines == [
        "0 http://127.0.0.1:9/rollouts/r9/v1",
        "1 http://127.0.0.1:9/rollouts/r9/attempts/1/v1",
        "2 http://127.0.0.1:9/rollouts/r9/attempts/2/v1",
    ]
    assert [o.cause for o in exits] == [Cause.INFRA_ERROR, Cause.INFRA_ERROR, Cause.OK]


async def test_retries_are_bounded(tmp_path: Path) -> None:
    argv = script(tmp_path, "always75", "import sys; sys.exit(75)")
    runner = CommandRunner(argv, ENDPOINT, retries=1)
    await runner.start()
    outcome = await runner.run(spec())
    assert outcome.cause is Cause.INFRA_ERROR and outcome.attempts == 2


async def test_hanging_harness_is_killed_with_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    argv = script(
        tmp_path,
        "hang",
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[1], "w").write(str(child.pid))
        time.sleep(600)
        """,
    ) + [str(pid_file)]
    runner = CommandRunner(argv, ENDPOINT, timeout_s=1.5, retries=3)
    await runner.start()
    outcome = await runner.run(spec())
    assert outcome.cause is Cause.TIMEOUT and outcome.attempts == 1  # a timeout is not retried
    assert "killed after 1.5 s" in outcome.message
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the harness's child survived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent was killed; init reaps it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def test_missing_harness_command_is_a_clear_error(tmp_path: Path) -> None:
    runner = CommandRunner([str(tmp_path / "no-such-harness")], ENDPOINT)
    await runner.start()
    with pytest.raises(HarnessNotFound, match="no-such-harness"):
        await runner.run(spec())


async def test_concurrency_limit(tmp_path: Path) -> None:
    """At most `concurrency` harnesses run at once, and that many do: each harness waits until a second
    one is running (a runner with a free slot starts the next), or until every other one has finished
    (the last may have no partner left), so a runner that ran them one by one fails `most == 2`. No
    wait depends on how fast the machine starts processes (it did: a partner had 2 s to start, which
    a loaded machine can exceed); 60 s only bounds how long a one-by-one runner takes to fail."""
    log = tmp_path / "spans.txt"
    argv = script(
        tmp_path,
        "slow",
        """
        import os, sys, time
        log, me = sys.argv[1], f"{sys.argv[1]}.running-{os.getpid()}"
        start = time.time(); open(me, "w").close()
        folder, prefix = os.path.dirname(log), os.path.basename(log) + ".running-"
        def running(): return sum(name.startswith(prefix) for name in os.listdir(folder))
        def finished(): return len(open(log).read().splitlines()) if os.path.exists(log) else 0
        while running() < 2 and finished() < 5 and time.time() < start + 60:
            time.sleep(0.01)
        time.sleep(0.1)
        os.remove(me)
        open(log, "a").write(f"{start} {time.time()}\\n")
        """,
    ) + [str(log)]
    runner = CommandRunner(argv, ENDPOINT, concurrency=2)
    await runner.start()
    import asyncio

    outcomes = await asyncio.gather(*(runner.run(spec(f"r{i}")) for i in range(6)))
    assert all(o.ok for o in outcomes)
    intervals = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    assert len(intervals) == 6
    most = max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)
    assert most == 2


async def test_grader_turns_a_finished_rollout_into_a_reward(tmp_path: Path) -> None:
    harness = script(tmp_path, "h", "print('answer: 42')")
    grader = script(
        tmp_path,
        "grade",
        """
        import os
        text = open(os.environ["AGL_ROLLOUT_LOG"]).read()
        print("grading", os.environ["AGL_ROLLOUT_ID"])
        print(1.0 if "42" in text else 0.0)
        """,
    )
    rewards = []

    async def sink(s: RolloutSpec, value: float) -> None:
        rewards.append((s.rollout_id, value))

    runner = CommandRunner(harness, ENDPOINT, log_dir=tmp_path / "logs", grader=grader, reward_sink=sink)
    await runner.start()
    outcome = await runner.run(spec("g1"))
    assert outcome.ok and outcome.reward == 1.0
    assert rewards == [("g1", 1.0)]


async def test_grader_without_a_number_fails_the_rollout(tmp_path: Path) -> None:
    harness = script(tmp_path, "h", "pass")
    grader = script(tmp_path, "bad", "print('looks good to me')")
    runner = CommandRunner(harness, ENDPOINT, grader=grader)
    await runner.start()
    outcome = await runner.run(spec())
    assert outcome.cause is Cause.HARNESS_ERROR
    assert "looks good to me" in outcome.message


# --- module:function harnesses in runner workers ------------------------------------------------


async def test_function_harness_runs_in_long_lived_workers(tmp_path: Path, otlp_sink) -> None:
    import asyncio

    out = tmp_path / "calls.jsonl"
    exits = []
    endpoint = Endpoint("http://127.0.0.1:7000", otlp_sink.endpoint)
    runner = FunctionRunner("tests.loop.harnesses:record", endpoint, workers=2, concurrency=4, on_exit=exits.append)
    await runner.start()
    try:
        outcomes = await asyncio.gather(
            *(runner.run(spec(f"f{i}", out=str(out), reward=i / 10)) for i in range(8))
        )
    finally:
        await runner.stop()
    assert all(o.ok for o in outcomes)
    assert [o.reward for o in outcomes] == [i / 10 for i in range(8)]
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert {c["base_url"] for c in calls} == {f"http://127.0.0.1:7000/rollouts/f{i}/v1" for i in range(8)}
    assert len({c["pid"] for c in calls}) <= 2  # start-up paid once per worker, not per rollout
    assert len(exits) == 8
    # The returned reward and the rollout's end travel as spans, attributed to each rollout.
    spans = otlp_sink.wait_for(
        lambda s: sum(x.name == semconv.SPAN_REWARD for x in s) >= 8
        and sum(x.name == semconv.SPAN_ROLLOUT for x in s) >= 8,
        timeout=30,
    )
    rewards = {
        s.attributes[semconv.ROLLOUT_ID]: s.attributes[semconv.REWARD_VALUE]
        for s in spans
        if s.name == semconv.SPAN_REWARD
    }
    assert rewards == {f"f{i}": i / 10 for i in range(8)}


async def test_a_worker_delivers_a_rollouts_spans_before_it_reports_the_rollout_ended(tmp_path: Path, otlp_sink) -> None:
    """A worker lives on after a rollout, so its SDK batch would leave on the batch's schedule; the
    trainer reads a rollout once its harness ended (plus loop.completion_grace_s), so the reward and
    the rollout's end must already be at the receiver when the outcome comes back."""
    endpoint = Endpoint("http://127.0.0.1:7000", otlp_sink.endpoint)
    runner = FunctionRunner("tests.loop.harnesses:record", endpoint, workers=1)
    await runner.start()
    try:
        for i in range(3):
            outcome = await runner.run(spec(f"d{i}", out=str(tmp_path / "calls.jsonl"), reward=0.5))
            assert outcome.ok
            names = [(x.name, x.attributes.get(semconv.ROLLOUT_ID)) for x in otlp_sink.spans]
            assert (semconv.SPAN_REWARD, f"d{i}") in names and (semconv.SPAN_ROLLOUT, f"d{i}") in names, names
    finally:
        await runner.stop()


async def test_async_function_harness(tmp_path: Path) -> None:
    runner = FunctionRunner("tests.loop.harnesses:async_record", ENDPOINT, workers=1)
    await runner.start()
    try:
        outcome = await runner.run(spec("a1", out=str(tmp_path / "o.jsonl"), reward=0.25))
    finally:
        await runner.stop()
    assert outcome.ok and outcome.reward == 0.25


async def test_function_harness_errors_hangs_and_dead_workers(tmp_path: Path) -> None:
    runner = FunctionRunner("tests.loop.harnesses:crash", ENDPOINT, workers=1, retries=2)
    await runner.start()
    try:
        crashed = await runner.run(spec("c1"))
    finally:
        await runner.stop()
    assert crashed.cause is Cause.HARNESS_ERROR and crashed.attempts == 1
    assert "ValueError: harness bug on task t1" in crashed.message

    runner = FunctionRunner("tests.loop.harnesses:hang", ENDPOINT, workers=1, timeout_s=0.5)
    await runner.start()
    try:
        hung = await runner.run(spec("h1", sleep=3))
    finally:
        await runner.stop()
    assert hung.cause is Cause.TIMEOUT

    marker = tmp_path / "died-once"
    runner = FunctionRunner("tests.loop.harnesses:die", ENDPOINT, workers=1, retries=1)
    await runner.start()
    try:
        revived = await runner.run(spec("d1", marker=str(marker)))
    finally:
        await runner.stop()
    assert marker.exists()
    assert revived.cause is Cause.OK and revived.attempts == 2 and revived.spec.attempt == 1


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("tests.loop.no_such_module:run", "cannot import module 'tests.loop.no_such_module'"),
        ("tests.loop.harnesses:missing", "has no attribute 'missing'"),
        ("tests.loop.harnesses:not_callable", "is not callable"),
    ],
)
async def test_missing_function_harness_is_a_clear_error(reference: str, message: str) -> None:
    runner = FunctionRunner(reference, ENDPOINT, workers=1)
    with pytest.raises(HarnessNotFound, match=message):
        await runner.start()
    await runner.stop()


def test_a_worker_killed_mid_traffic_blocks_neither_the_others_nor_exit(tmp_path: Path) -> None:
    """A worker dies while its threads report results and more requests than a pipe holds (64 KiB)
    are queued for it: the other worker keeps answering, every rollout ends, and the process exits.
    (Workers once shared one result queue, whose cross-process lock a killed writer never released,
    and a dead worker's full request queue held the interpreter at exit.)"""
    program = textwrap.dedent(
        f"""
        import asyncio
        from agl_trainer.runners.base import Cause, Endpoint, RolloutSpec
        from agl_trainer.runners.workers import FunctionRunner

        endpoint = Endpoint(sidecar_url="http://127.0.0.1:9", otlp_endpoint="http://127.0.0.1:8")

        async def main():
            runner = FunctionRunner("tests.loop.harnesses:die_mid_traffic", endpoint, workers=2, concurrency=64,
                                    retries=1, timeout_s=30)
            await runner.start()
            try:
                tasks = [{{"id": f"t-{{i}}", "marker": {str(tmp_path / "marker")!r}, "pad": "x" * 16384,
                           "error_bytes": 262_144}} for i in range(128)]
                outcomes = await asyncio.gather(
                    *(runner.run(RolloutSpec(rollout_id="r" + t["id"], task_id=t["id"], task=t)) for t in tasks)
                )
            finally:
                await runner.stop()
            causes = [o.cause for o in outcomes]
            assert causes.count(Cause.HARNESS_ERROR) == 128, [(o.spec.task_id, o.cause, o.message[:80]) for o in outcomes if o.cause is not Cause.HARNESS_ERROR]
            assert any(o.attempts == 2 for o in outcomes)
            print("done")

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    path = tmp_path / "run_workers.py"
    path.write_text(program)
    # Output to files, not pipes: a worker left alive would hold a pipe open past a timeout.
    with open(tmp_path / "out.txt", "w") as out:
        process = subprocess.Popen([sys.executable, str(path)], cwd=Path(__file__).parents[2], stdout=out, stderr=out)
        try:
            code = process.wait(timeout=150)
        except subprocess.TimeoutExpired:
            process.kill()
            code = None
    text = (tmp_path / "out.txt").read_text()
    assert code == 0 and "done" in text, text[-3000:]


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "crashed-without-stop"])
def test_a_process_whose_worker_died_with_a_full_queue_still_exits(tmp_path: Path, stopped: bool) -> None:
    """A worker dies with more requests queued for it than a pipe holds (64 x 16 KiB), and the
    trainer exits, with or without stopping the runner (a crash or an interrupt skips stop()). With
    a multiprocessing.Queue the feeder thread stayed blocked on the dead worker's full pipe and the
    interpreter waited for it at exit, forever. Runs in its own process group with a hard timeout,
    output to a file, so a regression fails instead of hanging the suite."""
    program = textwrap.dedent(
        f"""
        import asyncio, os, signal
        from agl_trainer.runners.base import Endpoint, RolloutSpec
        from agl_trainer.runners.workers import FunctionRunner

        async def main():
            endpoint = Endpoint(sidecar_url="http://127.0.0.1:9", otlp_endpoint="")
            runner = FunctionRunner("tests.loop.harnesses:hang", endpoint, workers=1, concurrency=64, retries=0)
            await runner.start()
            [worker] = runner._workers
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.join()  # dead before the runner's watcher can notice and discard its queue
            tasks = [
                asyncio.ensure_future(runner.run(RolloutSpec(f"r{{i}}", f"t{{i}}", {{"pad": "x" * 16384}})))
                for i in range(64)
            ]
            await asyncio.sleep(0.1)  # every request is now queued for the dead worker
            if {stopped!r}:
                await runner.stop()
            print("leaving", flush=True)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    path = tmp_path / "exit_with_full_queue.py"
    path.write_text(program)
    with open(tmp_path / "out.txt", "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(path)],
            cwd=Path(__file__).parents[2],
            stdout=out,
            stderr=out,
            start_new_session=True,  # its workers too are killed on a timeout
        )
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    text = (tmp_path / "out.txt").read_text()
    assert "leaving" in text, text[-3000:]
    assert code == 0, f"the process did not exit (exit code {code}): {text[-3000:]}"
