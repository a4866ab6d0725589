"""Read back a W&B offline run (its run-*.wandb file): the history rows and summary it recorded.

The file is W&B's record log (the LevelDB log layout): a 7-byte header (":W&B", 0xBEE1, version 0),
then 32 KiB blocks of records, each `<crc32 u32><length u16><type u8>` + data, a record split over
blocks as FIRST/MIDDLE/LAST pieces; each whole record is a wandb_internal_pb2.Record. wandb 0.31
ships no reader for it (its Go core writes it), so the test reads it here."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    out: list[bytes] = []
    pending = b""
    offset = HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        if kind == 0 and length == 0:
            offset += room  # the block's zero padding
            continue
        piece = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == FULL:
            out.append(piece)
        elif kind == FIRST:
            pending = piece
        elif kind == MIDDLE:
            pending += piece
        elif kind == LAST:
            out.append(pending + piece)
            pending = b""
    return out


def read_run(run_dir: Path) -> dict[str, Any]:
    """{"history": [{key: value}, ...], "summary": {key: value}, "config": {key: value}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for data in records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return {"history": history, "summary": summary, "config": config}
