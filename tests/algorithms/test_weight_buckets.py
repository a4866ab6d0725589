"""Weights for the engine laid out in host buckets (backends/weight_buckets.py): every tensor back
with its name, shape, dtype and values; floating ones cast once; across a process boundary as NumPy
buffers that come back as memory of the receiver's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from agl_trainer.backends import weight_buckets
from agl_trainer.backends.weight_buckets import ALIGN, BucketWriter, WeightBuckets, host_copy, write_buckets


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(50, 7, generator=generator)),
        ("norm.weight", torch.randn(7, generator=generator).bfloat16()),
        ("scale", torch.tensor(3.5)),  # a scalar
        ("empty", torch.zeros(0, 4)),
        ("steps", torch.arange(5, dtype=torch.int64)),  # not floating: never cast
        ("mask", torch.tensor([True, False, True])),
        ("odd", torch.randn(3, 3, generator=generator)[:, 1]),  # not contiguous
    ]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_every_tensor_comes_back_cast_once_if_floating(dtype, monkeypatch):
    monkeypatch.setattr(weight_buckets, "BUCKET_BYTES", 256)  # several buckets, one tensor larger than one
    named = named_tensors()
    buckets = write_buckets(named, dtype)
    assert len(buckets.buffers) >= 2
    out = buckets.tensors()
    assert list(out) == [name for name, _ in named]
    for name, tensor in named:
        want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        assert out[name].dtype == want.dtype and out[name].shape == want.shape, name
        assert torch.equal(out[name], want), name
    for entry in buckets.entries:
        assert entry.offset % ALIGN == 0


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_host_copy_casts_floating_weights_once_and_never_aliases(dtype):
    for name, tensor in named_tensors():
        copy = host_copy(tensor, dtype)
        want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        assert copy.dtype == want.dtype and torch.equal(copy, want), name
        assert copy.numel() == 0 or copy.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


def test_buffers_cross_as_numpy_and_come_back_as_tensors_of_their_own(tmp_path):
    from safetensors.torch import load_file, save_file

    named = named_tensors()
    arrays, entries = write_buckets(named, torch.bfloat16).to_wire()
    assert all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in arrays)
    for array in arrays:  # what Ray's object store hands out
        array.setflags(write=False)
    received = WeightBuckets.from_wire(arrays, entries)
    assert torch.equal(received["embed.weight"], named[0][1].bfloat16())
    storages = {t.untyped_storage().data_ptr() for t in received.values() if t.numel()}
    assert len(storages) == sum(1 for t in received.values() if t.numel())  # none shared: no false ties
    save_file(received, tmp_path / "w.safetensors")  # refuses tensors that share storage
    assert torch.equal(load_file(tmp_path / "w.safetensors")["norm.weight"], named[1][1])
    received["embed.weight"].zero_()  # memory of its own: writable, and the source is untouched
    assert torch.equal(WeightBuckets.from_wire(arrays, entries)["embed.weight"], named[0][1].bfloat16())


def test_an_empty_export_is_empty():
    assert write_buckets([]).tensors() == {}
    assert BucketWriter().finish().nbytes == 0
