"""`python -m finetune.vllm`: vLLM on devices of its own, sampling an online method's completions (GRPO's,
RLOO's) for a training run that names it with method.vllm=true method.vllm_servers=[HOST:PORT] (TRL's vllm_mode=server).

    CUDA_VISIBLE_DEVICES=7 python -m finetune.vllm --port 8000      # in vLLM's own virtualenv
    python -m finetune.launch +recipe=quickstart_grpo method.vllm=true method.vllm_servers=[localhost:8000] ...

It holds no model until a run sends its own: the run's rank 0 sends the policy's config and tokenizer (/init; vLLM is
built from them with dummy weights, once per model), pushes the policy's weights before each rollout (/weights: a
stream over a process group of the two, finetune.vllm.wire), and each rank asks for its prompts' completions
(/generate: seeded per prompt as the colocated engine is, so a run samples what it would sample colocated). Training
devices hold no sampler; the run's ranks wait for the push, then sample, one request at a time (one engine, on one
thread).

It samples for one run at a time: a run's requests carry its id (rank 0's, shared with every rank), and another run's
are refused (409, naming what to do) until the run ends (/close, when it finishes) or has asked nothing for --idle-s
seconds (a run that crashed); so two runs never push weights into, and sample from, one engine in turn.

GET /health answers {"ok": true, "model": whether one is built, "run": the run it samples for (null: none), "pushes":
weights pushed, "requests": completions served}.
The server imports nothing of finetune but finetune.vllm.engine and finetune.vllm.wire: in vLLM's virtualenv
`pip install --no-deps finetune` is enough.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from finetune.vllm import engine as vllm_engine, wire as vllm_wire


class Engine:
    """The server's one vLLM engine, the weights group, and what it has done; every request's work runs on one thread of
    its own (`worker`), in turn: vLLM and the process group see one caller, whichever HTTP thread took the request."""

    def __init__(self, memory: float, idle: float = 600.0) -> None:
        self.memory, self.idle, self.worker = memory, idle, ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.run: str | None = None  # the run it samples for
        self.seen = 0.0  # when that run last asked (time.monotonic)
        self.llm: Any = None
        self.key: str | None = None  # the model it was built for (its /init body)
        self.directory: Path | None = None
        self.pg: Any = None
        self.store_at: tuple[str, int] | None = None
        self.device: Any = None
        self.pushes = self.requests = 0  # since the server started
        self.dummy = True  # the engine holds no weights pushed since it was built

    def health(self, _: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "model": self.llm is not None, "run": self.run, "pushes": self.pushes, "requests": self.requests}

    def serving(self, body: dict[str, Any], *, claim: bool = False) -> None:
        """The request is the run's this server samples for (or, `claim`ing it, no other run's is live); Busy otherwise."""
        run, idle = str(body["run"]), time.monotonic() - self.seen
        if run != self.run and (not claim or (self.run is not None and idle < self.idle)):
            raise Busy(f"this server samples for another run (its last request {idle:.0f} s ago; it is free when that run ends "
                       f"or after --idle-s={self.idle:g} s without a request): start a server of its own for this run"
                       if self.run is not None else "this server samples for no run now (it ended, or another took the "
                       "server after it was idle): start the run again")
        self.run, self.seen = run, time.monotonic()

    def close(self, body: dict[str, Any]) -> dict[str, Any]:
        """The run ended: the server is free for another."""
        if str(body["run"]) == self.run:
            self.run = None
        return {"closed": True}

    def init(self, body: dict[str, Any]) -> dict[str, Any]:
        """A run's model: its config (config.json's fields) and tokenizer files; built anew unless the same was."""
        self.serving(body, claim=True)
        key = json.dumps({k: body[k] for k in ("config", "files", "dtype", "max_model_len")}, sort_keys=True)
        if key == self.key:
            return {"built": False}
        directory = Path(tempfile.mkdtemp(prefix="finetune-vllm-server-"))
        (directory / "config.json").write_text(json.dumps(body["config"]))
        for name, data in body["files"].items():
            if Path(name).name != name or name == "config.json":
                raise ValueError(f"/init: a tokenizer file is named {name!r}: names only, no directories")
            (directory / name).write_bytes(base64.b64decode(data))
        self.llm = None  # the old engine's memory released before the new one takes its share
        self.llm = vllm_engine.build(str(directory), dtype=body["dtype"], seed=0, memory=self.memory, max_model_len=body["max_model_len"])
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory, self.key, self.dummy = directory, key, True
        return {"built": True}

    def weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """The run's push: joins its weights group (the first time, or a new run's), loads every tensor as it arrives."""
        import torch

        self.serving(body)
        if self.llm is None:
            raise ValueError("/weights before /init: the server holds no model yet")
        at = (str(body["host"]), int(body["port"]))
        if at != self.store_at:
            store = torch.distributed.TCPStore(at[0], at[1], 2, False, timeout=vllm_wire.TIMEOUT)
            self.pg = vllm_wire.group(store, 1, body["backend"])
            self.store_at, self.device = at, torch.device("cuda" if body["backend"] == "nccl" else "cpu")
        loaded, failed = 0, None
        for name, value in vllm_wire.received(self.pg, self.device):  # to the end even after a failure: the run is sending
            try:
                if failed is None:
                    vllm_engine.load(self.llm, [(name, value)])
                    loaded += 1
            except Exception as e:  # said once the stream is drained, so the run is not left waiting on a broadcast
                failed = ValueError(f"loading {name} ({tuple(value.shape)}, {value.dtype}): {type(e).__name__}: {e}")
        if failed is not None:
            self.dummy = True  # some weights are the run's, some are not: nothing is sampled from it until a whole push
            raise failed
        self.llm.reset_prefix_cache()
        self.pushes, self.dummy = self.pushes + 1, False
        return {"loaded": loaded}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        self.serving(body)
        if self.dummy:
            raise ValueError("/generate before a whole /weights push: the engine does not hold the run's weights")
        out = vllm_engine.sample(self.llm, body["prompts"], n=int(body["n"]), temperature=float(body["temperature"]),
                                 top_p=float(body["top_p"]), max_tokens=int(body["max_tokens"]), seed=int(body["seed"]))
        self.requests += 1
        return {"completions": out}


class Busy(Exception):
    """A request of another run than the one the server samples for (HTTP 409)."""


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    routes = {"/health": engine.health, "/init": engine.init, "/weights": engine.weights, "/generate": engine.generate,
              "/close": engine.close}

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            route = routes.get(self.path)
            if route is None:
                return self.reply(404, {"error": f"no endpoint {self.path}: {', '.join(routes)}"})
            try:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else {}
                out = route(body) if route == engine.health else engine.worker.submit(route, body).result()  # health: at once
            except Busy as e:
                return self.reply(409, {"error": str(e)})
            except (KeyError, ValueError, TypeError) as e:
                return self.reply(400, {"error": f"{type(e).__name__}: {e}"})
            except Exception as e:  # the engine's own failure: said to the run, which stops with it
                print(f"finetune.vllm: {self.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                return self.reply(500, {"error": f"{type(e).__name__}: {e}"})
            self.reply(200, out)

        do_GET = do_POST = answer

        def reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # one line per request on stderr, without the client's address
            print(f"finetune.vllm: {format % args}", file=sys.stderr, flush=True)

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on (0: a free one, printed)")
    parser.add_argument("--gpu-memory", type=float, default=0.9, help="the share of the GPU vLLM takes (gpu_memory_utilization)")
    parser.add_argument("--idle-s", type=float, default=600.0, help="a run that asked nothing for this long frees the server")
    args = parser.parse_args(argv)
    if not 0 < args.gpu_memory < 1:
        parser.error(f"--gpu-memory={args.gpu_memory:g}: a share of the GPU, between 0 and 1")
    server = ThreadingHTTPServer((args.host, args.port), handler(Engine(args.gpu_memory, args.idle_s)))
    print(f"finetune.vllm: serving on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
