"""The policy's weights for an engine, cast once and copied once, for both backends.

Every weight sync starts with the full weights on the host under Hugging Face names. Done as
`tensor.to("cpu", dtype)` from a GPU, PyTorch copies the float32 master weights to pageable memory
and casts there (a blocking device-to-host copy casts on the CPU): twice the bytes over the bus and a
host pass per tensor. `host_copy` casts on the tensor's device first, then copies once.

Between processes (verl's workers to the driver, through Ray's object store) the weights travel in a
few large uint8 host buffers ("buckets"): each tensor cast on its device and copied once into a slice
of one (pinned staging reused across syncs when the source is on a GPU: copies queued without
waiting, one synchronisation at the end). Ray's serializer passes NumPy arrays out of band (one copy
into its object store), where a dict of tensors is pickled storage by storage; the receiver copies
each tensor once out of the object store into memory of its own (`WeightBuckets.from_wire`).
Tensors handed to callers never share storage: safetensors and save_pretrained take shared storage
for tied weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

BUCKET_BYTES = 256 << 20  # a bucket's size; a larger tensor gets a bucket of its own
ALIGN = 64  # every tensor starts at a multiple of this in its bucket (any dtype's view is aligned)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. bfloat16
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes into the bucket


@dataclass
class WeightBuckets:
    """Named tensors laid out in uint8 host buffers; `tensors()` gives views into them."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for entry in self.entries:
            dtype = getattr(torch, entry.dtype)
            size = _numel(entry.shape) * _element_size(dtype)
            raw = self.buffers[entry.bucket][entry.offset : entry.offset + size]
            out[entry.name] = raw.view(dtype).view(entry.shape)
        return out

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)

    def to_wire(self) -> tuple[list[Any], list[Entry]]:
        """NumPy views of the buckets (Ray's serializer moves NumPy arrays out of band, one copy
        into its object store) and the entries: what a Ray call returns."""
        return [buffer.numpy() for buffer in self.buffers], list(self.entries)

    @staticmethod
    def from_wire(arrays: list[Any], entries: list[Entry]) -> dict[str, torch.Tensor]:
        """The named tensors from `to_wire`'s arrays, each copied once into memory of its own (Ray hands
        out read-only views of its object store)."""
        buffers = []
        for array in arrays:
            with warnings.catch_warnings():  # read-only: only read, by the copies right here
                warnings.simplefilter("ignore", UserWarning)
                buffers.append(torch.from_numpy(array))
        return {name: tensor.clone() for name, tensor in WeightBuckets(buffers, entries).tensors().items()}


class BucketWriter:
    """Fills buckets with tensors, each cast on its device and copied once. With `staging` (a list the
    caller keeps across calls), copies from a GPU are queued into pinned buckets that are reused: use
    it only when the result is copied out before the next fill (verl's worker: Ray copies it)."""

    def __init__(self, dtype: torch.dtype | None = None, staging: list[torch.Tensor] | None = None) -> None:
        self.dtype = dtype
        self.staging = staging
        self.out = WeightBuckets()
        self._fill = 0  # bytes used in the last bucket
        self._pending_device = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        dtype = tensor.dtype
        if self.dtype is not None and tensor.is_floating_point():
            dtype = self.dtype
        on_device = tensor.device.type != "cpu"
        if on_device and dtype != tensor.dtype:
            tensor = tensor.to(dtype)  # on its own device: fewer bytes to the host, no host pass
        size = tensor.numel() * _element_size(dtype)
        queued = on_device and self.staging is not None  # into pinned staging, no wait
        buffers = self.out.buffers
        if not buffers or self._fill + size > buffers[-1].numel():
            buffers.append(self._new_bucket(max(BUCKET_BYTES, size), pinned=queued))
            self._fill = 0
        offset = self._fill
        target = buffers[-1][offset : offset + size].view(dtype).view(tensor.shape)
        target.copy_(tensor, non_blocking=queued)  # on the CPU the cast and the copy are one pass
        self._pending_device = self._pending_device or queued
        self.out.entries.append(
            Entry(name, str(dtype).removeprefix("torch."), tuple(tensor.shape), len(buffers) - 1, offset)
        )
        self._fill = offset + -(-size // ALIGN) * ALIGN

    def finish(self) -> WeightBuckets:
        """The filled buckets (the last one trimmed), once every queued copy has landed."""
        if self._pending_device:
            torch.cuda.synchronize()
        buffers = self.out.buffers
        if buffers:
            buffers[-1] = buffers[-1][: self._fill]
        return self.out

    def _new_bucket(self, size: int, pinned: bool) -> torch.Tensor:
        """A pinned staging bucket (reused across calls: pinning costs about as much as the copy), or
        fresh pageable memory (the caller keeps the result)."""
        if not pinned or self.staging is None:
            return torch.empty(size, dtype=torch.uint8)
        index = len(self.out.buffers)
        if index < len(self.staging) and self.staging[index].numel() >= size:
            return self.staging[index][:size]
        bucket = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if index < len(self.staging):
            self.staging[index] = bucket
        else:
            self.staging.append(bucket)
        return bucket


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of one weight, floating ones in `dtype`: cast on its device (half the bytes to move
    for bfloat16, no host pass), then copied once; on the CPU the cast is the copy."""
    source = tensor.detach()
    if dtype is not None and source.is_floating_point() and source.dtype != dtype:
        source = source.to(dtype)
        if source.device.type == "cpu":
            return source
    if source.device.type == "cpu":
        return source.clone(memory_format=torch.contiguous_format)
    return source.to("cpu")


def write_buckets(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> WeightBuckets:
    writer = BucketWriter(dtype)
    for name, tensor in named:
        writer.add(name, tensor)
    return writer.finish()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize
