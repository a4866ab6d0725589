"""The canary (loop/canary.py) and the agreement metrics on real runs: runner workers -> sidecar ->
embedded engine -> receiver -> torch backend. Each run breaks something on purpose (or nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from agl_trainer.config import load_config
from agl_trainer.loop.canary import VERDICTS, CanaryStop, judge

from tests.loop.test_loop import model_dir, run_session, write_tasks  # noqa: F401 - model_dir is a fixture

TASKS = [{"id": f"t{i}", "calls": 2, "key": f"k{i}"} for i in range(2)]


def canary_config(tmp_path: Path, model_dir: Path, *extra: str, max_steps: int = 2) -> Any:
    """A sync run of two steps, lr 1e-2 (the update moves the probes well past the tolerance 1e-3)."""
    base = [
        f"--tasks={write_tasks(tmp_path / 'tasks.jsonl', TASKS)}", f"--output_dir={tmp_path / 'run'}",
        f"--model.path={model_dir}", "--harness.function=tests.loop.harnesses:calls", "--harness.workers=1",
        "--harness.timeout_s=60", "--backend.lr=1e-2", "--loop.completion_grace_s=0.2", "--loop.mode=sync",
        "--loop.batch_rollouts=4", "--loop.group_size=2", "--loop.concurrency=4", f"--loop.max_steps={max_steps}",
        "--diagnostics.canary.tolerance=1e-3", "--viewer.enabled=false",
    ]  # fmt: skip
    return load_config(None, base + list(extra))


def metrics_rows(config: Any) -> list[dict[str, Any]]:
    lines = (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_normal_run_agrees_token_by_token(tmp_path: Path, model_dir: Path) -> None:
    config = canary_config(tmp_path, model_dir)
    result = run_session(config)
    assert result.summary.steps == 2
    for row in result.summary.history:
        agreement = {k: v for k, v in row.items() if k.startswith(("agreement/", "advantage/"))}
        assert row["agreement/lag0/tokens"] > 0, agreement
        assert row["agreement/lag0/mean_abs_delta"] < 1e-4, agreement  # fp32 engine, fp32 trainer
        assert row["agreement/canary/verdict"] == VERDICTS.index("agree"), agreement
        assert row["agreement/canary/mean_abs_delta"] < 1e-4, agreement
        # an update that moved the weights moved the probes, and the engine followed (a step whose
        # groups all tied has advantages 0 and moves nothing: the sampled rewards decide which)
        if row["advantage/max"] > row["advantage/min"]:
            assert row["agreement/canary/previous_mean_abs_delta"] > 1e-3, agreement
    written = [r for r in metrics_rows(config) if "agreement/lag0/mean_abs_delta" in r]
    assert len(written) == 2  # and the metrics reach metrics.jsonl, Prometheus and TensorBoard
    prom = (Path(config.output_dir) / "metrics.prom").read_text()
    assert "agl_train_agreement_lag0_mean_abs_delta " in prom and "agl_train_agreement_canary_ok 1.0" in prom
    assert any((Path(config.output_dir) / "tensorboard").iterdir())

    # the trace viewer: per token the trainer's logprob and |delta|, per sample a summary
    from agl_trainer.assembly import AssemblyConfig
    from agl_trainer.store import RolloutStore
    from agl_trainer.store import queries
    from agl_trainer.viewer import detail
    from agl_trainer.viewer.tokens import TokenDecoder

    out = Path(config.output_dir)
    with RolloutStore(out / "rollouts.db") as store:
        key = next(i.key for i in store.find("") if i.trained_step is not None)
    database = queries.Database(out / "rollouts.db")
    try:
        view = detail.rollout(database, key, AssemblyConfig(), TokenDecoder(), out)
    finally:
        database.close()
    sample = view["samples"][0]
    summary = sample["agreement"]
    assert summary["lag0_tokens"] == sample["trained_tokens"] and summary["lag0_mean_abs_delta"] < 1e-4
    trained = [i for i, role in enumerate(sample["roles"]) if role == "c"]
    assert all(sample["abs_delta"][i] is not None and sample["abs_delta"][i] < 1e-3 for i in trained)
    assert all(sample["abs_delta"][i] is None for i in range(len(sample["ids"])) if i not in trained)


@pytest.mark.slow
def test_weights_that_do_not_land_stop_the_run(tmp_path: Path, model_dir: Path) -> None:
    config = canary_config(
        tmp_path, model_dir, "--engine.options.fault_skip_weight_load=true", "--diagnostics.canary.action=stop",
        max_steps=5,
    )
    with pytest.raises(CanaryStop, match="weights did not land") as stopped:
        run_session(config)
    # at the first update that moved the weights (a step whose advantages are all 0 moves none)
    assert "[weights_not_loaded]" in str(stopped.value) and "Fix:" in str(stopped.value)
    rows = [r for r in metrics_rows(config) if "agreement/canary/verdict" in r]
    assert rows and rows[-1]["agreement/canary/verdict"] == VERDICTS.index("weights_not_loaded")
    assert rows[-1]["agreement/canary/previous_mean_abs_delta"] < 1e-4  # the engine still has the old weights


@pytest.mark.slow
def test_bf16_engine_against_fp32_trainer_is_numerics(tmp_path: Path, model_dir: Path) -> None:
    config = canary_config(tmp_path, model_dir, "--engine.options.dtype=bfloat16", max_steps=1)
    result = run_session(config)  # action warn: the run goes on
    row = result.summary.history[0]
    assert row["agreement/lag0/mean_abs_delta"] > 1e-4  # the drift is visible token by token (fp32: ~1e-7)
    assert row["agreement/lag0/max_abs_delta"] >= row["agreement/lag0/mean_abs_delta"]
    assert row["agreement/canary/verdict"] == VERDICTS.index("numerics")


@pytest.mark.slow
@pytest.mark.parametrize("action", ["warn", "stop"])
def test_an_async_loop_checks_beside_generation_unless_the_verdict_gates_the_resume(
    tmp_path: Path, model_dir: Path, action: str
) -> None:
    """collocated-async (drain): with action warn the canary after an update runs beside generation
    (its time is `background_s`, none of the step's) and reports with the next step; with action stop
    it runs before the resume, on the step's path, and reports with its own step."""
    config = canary_config(
        tmp_path, model_dir, "--loop.mode=collocated-async", f"--diagnostics.canary.action={action}", max_steps=3
    )
    rows = run_session(config).summary.history
    assert len(rows) == 3
    checked = [row for row in rows if "agreement/canary/verdict" in row]
    assert checked and all(row["agreement/canary/verdict"] == VERDICTS.index("agree") for row in checked)
    if action == "warn":
        assert "agreement/canary/verdict" not in rows[0]  # step 1's check reports with step 2
        assert all("agreement/canary/background_s" in row and "time/canary_s" not in row for row in rows[1:])
    else:
        assert all(row["time/canary_s"] > 0 and "agreement/canary/background_s" not in row for row in rows)


def test_judge_names_each_pattern() -> None:
    small, big = torch.full((20,), 1e-5), torch.full((20,), 0.3)
    drift = torch.linspace(0.01, 0.03, 20)
    assert judge(small, small, small, small, 1e-3)[0] == "agree"
    assert judge(big, small, big, big, 1e-3)[0] == "weights_not_loaded"
    assert judge(big, drift, big, big, 1e-3)[0] == "weights_not_loaded"  # a bf16 engine that kept its weights
    assert judge(drift, big, drift, drift, 1e-3)[0] == "numerics"  # a bf16 engine that loaded them
    assert judge(small, big, big, small, 1e-3)[0] == "stale_cache"
    assert judge(drift, drift, drift, drift, 1e-3)[0] == "numerics"
    # bf16 wobble near the tolerance: one probe a few times further off than the others is still numerics
    assert judge(drift / 20, drift, drift / 6, drift / 30, 1e-3)[0] == "numerics"
    spike = torch.cat([torch.zeros(19), torch.tensor([5.0])])
    assert judge(spike, spike, spike, spike, 1e-3)[0] == "mismatch"
    for verdict in ("weights_not_loaded", "stale_cache", "numerics", "mismatch"):
        assert verdict in VERDICTS


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("--diagnostics.canary.action=halt", "diagnostics.canary.action"),
        ("--diagnostics.canary.tolerance=0", "diagnostics.canary.tolerance"),
        ("--diagnostics.canary.probes=0", "diagnostics.canary.probes"),
        ("--diagnostics.canary.tokens=2", "diagnostics.canary.tokens"),
    ],
)
def test_bad_canary_settings_are_named(tmp_path: Path, override: str, named: str) -> None:
    from agl_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [f"--tasks={write_tasks(tmp_path / 't.jsonl', TASKS)}", override])


@pytest.mark.parametrize(
    ("cards", "probed"),
    [
        ([{"id": "tiny", "parent": None}], "tiny"),  # one served model: it is the policy
        # a LoRA run on vLLM: the base under an internal name, then the adapter the harness calls
        ([{"id": "tiny-base", "parent": None}, {"id": "tiny", "parent": "tiny-base"}], "tiny"),
    ],
)
def test_the_canary_probes_the_policy_the_harness_calls(cards: list, probed: str) -> None:
    import httpx

    from agl_trainer.engines.probes import HttpProbeEngine

    asked: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": cards})
        asked.append(json.loads(request.content)["model"])
        return httpx.Response(200, json={"choices": []})

    probes = HttpProbeEngine("http://engine")
    probes._client = httpx.Client(transport=httpx.MockTransport(engine))
    probes._post({"prompt": [[1, 2]], "max_tokens": 1})
    assert asked == [probed]


class _Replica:
    """A ProbeEngine answering every logprob with `value`; its two questions meet at `barrier`, so a
    canary that asked them one after the other would break it (and report an error)."""

    def __init__(self, value: float, barrier: Any) -> None:
        self.value, self.barrier, self.asked = value, barrier, 0

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        self.asked += 1
        self.barrier.wait(timeout=30)
        return [[self.value] * (len(p) - 1) for p in prompts]

    def generate(self, prefixes: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        self.barrier.wait(timeout=30)
        return [([5] * max_tokens, [self.value] * max_tokens) for _ in prefixes]


class _Trainer:
    def compute_logprobs(self, batch: Any) -> torch.Tensor:
        return torch.zeros(batch.input_ids.shape)


def test_the_canary_probes_each_replica_in_turn_and_names_the_one_that_disagrees() -> None:
    import threading

    from agl_trainer.loop.canary import Canary, CanarySettings

    barrier = threading.Barrier(2)
    good, stale = _Replica(0.0, barrier), _Replica(-0.5, barrier)
    canary = Canary(
        CanarySettings(probes=2, tokens=8), engines=[good, stale], vocab_size=50, backend=_Trainer(),
        names=["http://a:1", "http://b:2"],
    )  # fmt: skip
    results = [canary.check(version) for version in range(4)]
    assert [r.replica for r in results] == [0, 1, 0, 1] and (good.asked, stale.asked) == (2, 2)
    assert [r.verdict for r in results[::2]] == ["agree", "agree"]
    for result in results[1::2]:
        assert result.verdict not in ("agree", "error") and result.message.startswith("http://b:2: ")
        assert result.metrics()["agreement/canary/replica"] == 1.0
    assert results[0].metrics()["agreement/canary/replica"] == 0.0
