"""A checkpoint prints nothing: the loop saves one every loop.checkpoint_every steps, and each
save_pretrained drew a "Writing model shards" progress bar (hundreds of lines in the demo's log)."""

from __future__ import annotations

import threading

import pytest
from agl_trainer.backends import TorchBackend
from agl_trainer.models.hf_progress import quiet_progress
from transformers.utils import logging as hf_logging

from tests.algorithms.tiny import make_tiny_model, random_batch, training_config

BAR = "Writing model shards"


def test_checkpoints_and_weight_files_draw_no_progress_bar(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    backend = TorchBackend(training_config(make_tiny_model(tmp_path / "model"), lr=1e-3))
    backend.train_step(random_batch(2, 2, seed=0), 0)
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    backend.model.save_pretrained(tmp_path / "plain")  # the bar this is about, so the test can fail
    assert BAR in capfd.readouterr().err
    backend.save_checkpoint(tmp_path / "ckpt")
    backend.save_hf(tmp_path / "hf")
    out = capfd.readouterr()
    assert BAR not in out.err and BAR not in out.out
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").is_file()
    assert hf_logging.is_progress_bar_enabled()  # other calls' bars are as the user left them


def test_quiet_progress_nests_across_threads_and_restores_once() -> None:
    hf_logging.enable_progress_bar()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with quiet_progress():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    with quiet_progress():
        assert not hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()  # the other thread's save is still running
    release.set()
    thread.join(10)
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with quiet_progress():
        pass
    assert not hf_logging.is_progress_bar_enabled()  # off before: stays off
    hf_logging.enable_progress_bar()
