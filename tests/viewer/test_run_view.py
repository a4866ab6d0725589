"""The viewer opened on a run's store: tokens decoded with the run's own model (its config.yaml
beside the store names it) without --model, and a validation round's rollouts shown as `val`,
the ones sampled at the training temperature (stored with mode train) too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from agl_trainer.loop.validation import VAL_DROP_REASON
from agl_trainer.store import RolloutStore
from agl_trainer.store.queries import VALIDATION_DROP
from agl_trainer.store.records import RolloutKey
from agl_trainer.viewer import ViewerServer
from agl_trainer.viewer.run_model import run_model

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.viewer.conftest import get, start
from tests.viewer.stores import T0, save_tokenizer
from agl_testing.tiny_tokenizer import encode, special

TRAIN_ID, GREEDY_ID, SAMPLED_ID = "trained-one", "val-greedy", "val-sampled"


def run_config(run_dir: Path, output_dir: str, model: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"output_dir": output_dir, "model": {"path": model}}))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ViewerServer]:
    """A run as `agl train` leaves it, run from `root`: root/runs/demo/{config.yaml, rollouts.db},
    its model at root/runs/demo/model-warm, both paths in config.yaml relative to root."""
    root = tmp_path_factory.mktemp("checkout")
    run_dir = root / "runs" / "demo"
    run_config(run_dir, "runs/demo", "runs/demo/model-warm")
    save_tokenizer(run_dir / "model-warm")
    start_id, end = special("<|im_start|>"), special("<|im_end|>")
    prompt, answer = [start_id, *encode("user hello world"), end, start_id], [*encode("the answer is 42"), end]
    spans = []
    for rollout_id, mode in ((TRAIN_ID, "train"), (GREEDY_ID, "val"), (SAMPLED_ID, "train")):
        spans += [call_span(rollout_id, 0, prompt, answer, start_ns=T0, end_ns=T0 + 1_000_000),
                  reward_span(rollout_id, 1.0), rollout_span(rollout_id, mode=mode)]  # fmt: skip
    with RolloutStore(run_dir / "rollouts.db", grace_s=0.0) as store:
        ingest(store, spans)
        store.refresh_completion()
        store.mark_trained([TRAIN_ID], 1)
        store.mark_dropped([RolloutKey(GREEDY_ID, 0), RolloutKey(SAMPLED_ID, 0)], VAL_DROP_REASON)
    with start(run_dir / "rollouts.db") as running:  # no model given
        yield running


def test_the_runs_model_decodes_tokens_without_model(server: ViewerServer) -> None:
    status, overview = get(server, "/api/overview")
    assert status == 200
    assert Path(overview["model"]).parts[-3:] == ("runs", "demo", "model-warm")
    assert overview["model_source"] == "the run's config.yaml" and overview["tokenizer_error"] is None
    status, body = get(server, "/api/rollout?id=" + TRAIN_ID)
    assert status == 200 and body["decoded"] is True
    assert "the answer is 42" in "".join(body["samples"][0]["text"])


def test_traces_inspect_decodes_with_the_runs_model_too(server: ViewerServer, capsys) -> None:
    from agl_trainer.cli import main

    assert main(["traces", "inspect", TRAIN_ID, "--store", str(server.viewer.store_path)]) == 0
    assert "the answer is 42" in capsys.readouterr().out


def test_validation_rollouts_say_val_sampled_ones_too(server: ViewerServer) -> None:
    _, listing = get(server, "/api/rollouts")
    modes = {row["rollout_id"]: row["mode"] for row in listing["rows"]}
    assert modes == {TRAIN_ID: "train", GREEDY_ID: "val", SAMPLED_ID: "val"}
    _, val = get(server, "/api/rollouts?mode=val")
    assert {row["rollout_id"] for row in val["rows"]} == {GREEDY_ID, SAMPLED_ID}
    _, train = get(server, "/api/rollouts?mode=train")
    assert [row["rollout_id"] for row in train["rows"]] == [TRAIN_ID]
    _, page = get(server, "/api/rollout?id=" + SAMPLED_ID)
    assert page["info"]["mode"] == "val"
    assert VALIDATION_DROP == VAL_DROP_REASON  # the loop's word is the one the viewer reads


def test_run_model_finds_the_model_wherever_the_viewer_starts(tmp_path: Path) -> None:
    model = save_tokenizer(tmp_path / "models" / "m")
    run_config(tmp_path / "a" / "runs" / "x", "runs/x", "../models/m")  # relative to tmp/a
    assert run_model(tmp_path / "a" / "runs" / "x") == str(tmp_path / "a" / ".." / "models" / "m")
    run_config(tmp_path / "b", ".", str(model))  # an absolute model path is taken as it is
    assert run_model(tmp_path / "b") == str(model)
    run_config(tmp_path / "c" / "out", "./out/", "models/m")  # output_dir spelled another way
    (tmp_path / "c" / "models").symlink_to(tmp_path / "models")
    assert run_model(tmp_path / "c" / "out") == str(tmp_path / "c" / "models" / "m")


@pytest.mark.parametrize(
    ("output_dir", "model", "why"),
    [
        ("runs/other", "models/m", "the run dir does not end with output_dir: the base is unknown"),
        ("/abs/run", "models/m", "an absolute output_dir does not say where the run ran"),
        (".", "models/none", "the model is gone"),
        (".", "", "no model path"),
    ],
)
def test_run_model_gives_none_when_it_cannot_tell(tmp_path: Path, output_dir: str, model: str, why: str) -> None:
    save_tokenizer(tmp_path / "models" / "m")
    run_config(tmp_path / "run", output_dir, model)
    assert run_model(tmp_path / "run") is None, why


def test_run_model_without_a_run_record(tmp_path: Path) -> None:
    assert run_model(tmp_path) is None  # a store that is not in a run's directory
    (tmp_path / "config.yaml").write_text("model: [not, a, mapping\n")
    assert run_model(tmp_path) is None
    (tmp_path / "config.yaml").write_text("[" * 100_000 + "]" * 100_000)  # nested past the YAML parser's recursion
    assert run_model(tmp_path) is None
