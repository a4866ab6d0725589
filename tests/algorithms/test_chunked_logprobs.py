"""Log-probs and entropy over the vocabulary in chunks of positions (backends/chunked_logprobs.py):
bit for bit the unchunked values and gradients, without a whole float32 [positions x vocabulary]
tensor, and the torch backend's step unchanged by the chunk size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from agl_trainer.algorithms import AlgorithmConfig, token_entropy, token_logprobs
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.chunked_logprobs import chunk_positions, chunk_sizes, token_outputs
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.algorithms.tiny import make_tiny_model, random_batch, training_config

# a vocabulary past torch's 32,768-element grain: a lone row is then reduced in parallel
VOCAB, HIDDEN = 40_000, 8


def head_outputs(
    positions: int, dtype: torch.dtype, chunk: int | None, entropy_grad: bool, seed: int = 0, temperature: float = 1.0
):
    """log-probs, entropies and the gradients of a loss over both w.r.t. the hidden states and the
    head's weight; chunk None is the unchunked reference (the functions applied to the whole logits,
    divided by the temperature in float32)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, HIDDEN, generator=generator).requires_grad_()
    weight = (0.3 * torch.randn(VOCAB, HIDDEN, generator=generator)).requires_grad_()
    labels = torch.randint(0, VOCAB, (positions,), generator=generator)
    a, b = torch.randn(positions, generator=generator), torch.randn(positions, generator=generator)
    logits = F.linear(hidden.to(dtype), weight.to(dtype))  # as under bfloat16 autocast
    if chunk is None:
        scaled = logits if temperature == 1.0 else logits.float() / temperature
        log_prob = token_logprobs(scaled, labels)
        with torch.set_grad_enabled(entropy_grad):
            entropy = token_entropy(scaled)
    else:
        log_prob, entropy = token_outputs(
            logits, labels, entropy_grad=entropy_grad, chunk_tokens=chunk, temperature=temperature
        )
    assert entropy is not None
    loss = (a * log_prob).sum() + ((b * entropy).sum() if entropy_grad else 0.0)
    loss.backward()
    return log_prob.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy-grad", "no-entropy-grad"])
@pytest.mark.parametrize(("positions", "chunk"), [(9, 2), (9, 4), (9, 8), (13, 5), (3, 1), (1, 1), (9, 100)])
def test_values_and_gradients_equal_the_unchunked_exactly(positions, chunk, dtype, entropy_grad):
    want = head_outputs(positions, dtype, None, entropy_grad)
    got = head_outputs(positions, dtype, chunk, entropy_grad)
    for name, w, g in zip(("log_prob", "entropy", "hidden.grad", "weight.grad"), want, got, strict=True):
        assert torch.equal(g, w), name
    assert float(want[2].abs().max()) > 0 and float(want[3].abs().max()) > 0  # real gradients compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("positions", "chunk"), [(9, 4), (13, 5), (9, 100)])
def test_at_a_temperature_the_chunks_equal_the_scaled_softmax_exactly(positions, chunk, dtype):
    """loss_temperature: softmax(logits / T) in float32, chunked or not, the same bits; and not the
    model's own."""
    want = head_outputs(positions, dtype, None, True, temperature=0.6)
    got = head_outputs(positions, dtype, chunk, True, temperature=0.6)
    for name, w, g in zip(("log_prob", "entropy", "hidden.grad", "weight.grad"), want, got, strict=True):
        assert torch.equal(g, w), name
    own = head_outputs(positions, dtype, chunk, True)
    assert not torch.allclose(own[0], got[0]) and not torch.allclose(own[1], got[1])


def test_without_grad_the_values_equal_too():
    logits = torch.randn(11, VOCAB, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        log_prob, entropy = token_outputs(logits, labels, chunk_tokens=3)
        only, none = token_outputs(logits, labels, with_entropy=False, chunk_tokens=3)
    assert torch.equal(log_prob, token_logprobs(logits, labels)) and torch.equal(entropy, token_entropy(logits))
    assert torch.equal(only, log_prob) and none is None


class LargestFloat32(TorchDispatchMode):
    """The largest float32 tensor any operation produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("chunk", [None, 4])
def test_no_whole_float32_logits_in_forward_or_backward(chunk):
    positions = 16
    logits = torch.randn(positions, VOCAB).bfloat16().requires_grad_()  # the head's bfloat16 output
    labels = torch.randint(0, VOCAB, (positions,))
    with LargestFloat32() as seen:
        if chunk is None:  # the unchunked reference: it does make one, so this check can fail
            log_prob, entropy = token_logprobs(logits, labels), token_entropy(logits)
        else:
            log_prob, entropy = token_outputs(logits, labels, entropy_grad=True, chunk_tokens=chunk)
        (log_prob.sum() + entropy.sum()).backward()
    whole = positions * VOCAB
    if chunk is None:
        assert seen.largest >= whole
    else:
        assert seen.largest <= (chunk + 1) * VOCAB < whole
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


@given(positions=st.integers(1, 200), rows=st.integers(1, 50))
def test_chunks_cover_every_position_and_none_holds_one_row_among_others(positions, rows):
    sizes = chunk_sizes(positions, rows)
    assert sum(sizes) == positions
    assert all(size >= 2 for size in sizes) or sizes == [1]
    assert max(sizes) <= max(rows, 2) + 1


def test_default_chunk_keeps_a_chunk_within_64_mi_logits():
    assert chunk_positions(151_936) == 441 and chunk_positions(151_936, 100) == 100
    assert chunk_positions(10) == (1 << 26) // 10


def test_the_torch_backends_step_is_the_same_whatever_the_chunk(tmp_path: Path):
    model = make_tiny_model(tmp_path / "model")
    batch = random_batch(num_tasks=2, per_task=3, seed=5, max_calls=2, max_len=30)
    algorithm = AlgorithmConfig(entropy_coef=0.01)
    outcomes = []
    for chunk in (None, 3):
        backend = TorchBackend(training_config(model, algorithm=algorithm, logit_chunk_tokens=chunk))
        metrics = backend.train_step(batch, policy_version=0)
        outcomes.append((metrics, backend.state_dict_for_engine(), backend.compute_logprobs(batch)))
    (want, want_weights, want_lp), (got, got_weights, got_lp) = outcomes
    assert want["loss/total"] != 0 and want["actor/grad_norm"] > 0
    for key, value in want.items():
        if not key.startswith("perf/"):
            assert got[key] == value, key
    assert all(torch.equal(got_weights[name], tensor) for name, tensor in want_weights.items())
    assert torch.equal(got_lp, want_lp)


def test_bad_chunk_size_is_refused(tmp_path: Path):
    from agl_trainer.backends import BackendConfigError

    with pytest.raises(BackendConfigError, match="backend.logit_chunk_tokens: 0 must be >= 1"):
        training_config(make_tiny_model(tmp_path / "model"), logit_chunk_tokens=0)
