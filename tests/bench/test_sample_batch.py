"""bench/sample_batch.py: its reference (samples as lists, the padding before #41) and the product
build the same batch, on the bench's rollouts and on samples with every optional field, a NaN
logprob and a keep switch; what could be wrong is a padding, dtype or unknown-logprob rule lost
in the move to numpy. No timing is asserted."""

from __future__ import annotations

import numpy as np
from agl_trainer.assembly import AssemblyConfig
from agl_trainer.batch import TrainingBatch

from bench.sample_batch import as_lists, lists_from_rollouts, make_rollout, run_arrays, run_lists, same
from tests.test_batch_samples import rollouts


def test_the_bench_rollouts_pad_alike_through_arrays_and_through_lists():
    rng = np.random.default_rng(3)
    data = [make_rollout(i, n, rng) for i, n in enumerate([1500, 2600, 1200, 2100])]
    arrays, lists = run_arrays(data, AssemblyConfig()), run_lists(data, AssemblyConfig())
    assert arrays[2].input_ids.shape == (4, 1024 + 8 * ((2600 - 1024) // 8))  # one merged sample a rollout
    assert same(arrays[2], lists[2])


def test_samples_with_every_optional_field_pad_as_the_old_from_rollouts_did():
    given = rollouts(arrays=True)
    new = TrainingBatch.from_rollouts(given, pad_token_id=5)
    old = lists_from_rollouts([as_lists(r) for r in given], pad_token_id=5)
    assert bool((~new.logprob_known).any()) and bool(new.after_switch.any()) and bool(new.token_rewards.any())
    assert same(new, old)
