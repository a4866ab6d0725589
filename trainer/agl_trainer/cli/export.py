"""`agl export SOURCE --out DIR [--merged] [--adapter]`: a trained policy as files other tools load."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Write the policy of a checkpoint as files that transformers, vLLM and peft load, without the trainer.

SOURCE is a run's output directory (its latest checkpoint, checkpoints/latest), a checkpoints/
directory, one checkpoint (checkpoints/step_N) or its backend/ directory.

A LoRA checkpoint (backend.lora.rank > 0) holds the adapter; its base is the model the run trained
(model.path, recorded in the checkpoint; --base names it if it moved). It writes:
  OUT/           the merged model: base + adapter, safetensors (the base's shards and names), config,
                 generation config and tokenizer. AutoModelForCausalLM.from_pretrained(OUT), vllm serve OUT
  OUT/adapter/   the bare adapter in peft's format (adapter_config.json + adapter_model.safetensors):
                 PeftModel.from_pretrained(base, OUT/adapter), or
                 vllm serve BASE --enable-lora --lora-modules NAME=OUT/adapter
  --merged writes only the merged model (OUT), --adapter only the adapter (OUT holds its files);
  both are the default.
A full-training checkpoint holds the whole model: OUT is that model as saved (--adapter is refused).

The merge adds scaling x B @ A to each adapted weight in float32 and rounds once to the weight's
dtype (--dtype auto keeps the stored dtype), as the trainer merges for an engine that takes no adapter.
OUT must not exist or be empty unless --force (it is then replaced; written beside it, then moved in).

examples:
  agl export runs/swe-lora --out exports/swe-lora              # merged model + exports/swe-lora/adapter
  agl export runs/swe-lora/checkpoints/step_000040 --out exports/step40 --adapter
  agl export runs/swe-lora --out exports/merged --merged --base /models/Qwen3-8B --dtype bfloat16
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint as a merged model (transformers, vLLM) and, for LoRA, the bare adapter",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("source", metavar="SOURCE", help="a run's output_dir or a checkpoint (see above)")
    add("--out", required=True, metavar="DIR", help="where to write (see above for the layout)")
    add("--merged", action="store_true", help="only the merged model (in OUT)")
    add("--adapter", action="store_true", help="only the bare adapter, peft format (in OUT); LoRA only")
    add("--base", metavar="MODEL_DIR", help="the base model of a LoRA checkpoint (default: the run's)")
    add("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
        help="the merged model's weights (default auto: as the base stores them)")  # fmt: skip
    add("--force", action="store_true", help="replace OUT when it exists and is not empty")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError
    from agl_trainer.cli.export_files import ExportError, export

    chosen = args.merged or args.adapter  # neither: the merged model, and the adapter where there is one
    try:
        written = export(
            Path(args.source),
            Path(args.out),
            merged=args.merged or not chosen,
            adapter=args.adapter if chosen else None,
            base=Path(args.base) if args.base else None,
            dtype=args.dtype,
            force=bool(args.force),
        )
    except ExportError as error:
        raise CLIError(str(error)) from None
    for line in written:
        print(f"agl export: {line}")
    return 0
