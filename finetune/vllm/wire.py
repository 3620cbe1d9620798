"""What a training run (method.vllm_servers) and its vLLM server (finetune.vllm) say to each other: JSON over HTTP
for requests (the run's model and tokenizer, prompts and completions), and the policy's weights over a process group
of two of their own (the training's rank 0 and the server; NCCL between GPUs, gloo otherwise), set up with a TCP
store the run's rank 0 holds: separate from the run's own process group, which the server never joins.

A push is a stream of broadcasts from the run: for each tensor a header (its dimensions, dtype and name's length),
its name's bytes, and its values; a header of -1 ends it. The server loads each into vLLM as it arrives, so it never
holds more than one tensor beyond its engine.

Imports nothing of finetune (the server runs in vLLM's own virtualenv).
"""

from __future__ import annotations

import datetime
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterable

DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
HEADER = 12  # ndim, up to 9 dimensions, dtype, the name's length
TIMEOUT = datetime.timedelta(minutes=10)  # a broadcast waits this long for the other side (the server loading a tensor)


class ServerError(RuntimeError):
    """The server answered with an error, or none answers at the address."""


def call(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """POST `body` as JSON to url + path (GET where None) -> the JSON answer; ServerError with the server's own message."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        raise ServerError(f"the vLLM server at {url} refused {path}: {json.loads(e.read() or b'{}').get('error', e.reason)}") from None
    except (urllib.error.URLError, ConnectionError, socket.timeout) as e:
        raise ServerError(f"no vLLM server answers at {url} ({getattr(e, 'reason', e)}): start one on the devices it should use with "
                          f"`python -m finetune.vllm --port {url.rpartition(':')[2]}` (docs/grpo.md, vLLM server)") from None


def facing(host: str) -> str:
    """This machine's address on the route to `host` (what the server connects back to); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def group(store: Any, rank: int, backend: str) -> Any:
    """The process group of two (the run's rank 0: 0, the server: 1) over `store`; both sides block here until the
    other joins."""
    import torch.distributed as dist

    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


def broadcast(pg: Any, tensor: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def send(pg: Any, weights: Iterable[tuple[str, Any]], device: Any) -> int:
    """Every (name, tensor) to the server, then the end; -> how many were sent."""
    import torch

    sent = 0
    for name, value in weights:
        if value.dim() > HEADER - 3:
            raise ValueError(f"{name} has {value.dim()} dimensions: the weights' header carries at most {HEADER - 3}")
        encoded = name.encode()
        header = [value.dim(), *value.shape, *[0] * (HEADER - 3 - value.dim()), DTYPES.index(str(value.dtype).removeprefix("torch.")), len(encoded)]
        broadcast(pg, torch.tensor(header, dtype=torch.int64, device=device))
        broadcast(pg, torch.tensor(list(encoded), dtype=torch.uint8, device=device))
        broadcast(pg, value.detach().to(device).contiguous())
        sent += 1
    broadcast(pg, torch.tensor([-1] + [0] * (HEADER - 1), dtype=torch.int64, device=device))
    return sent


def received(pg: Any, device: Any) -> Iterable[tuple[str, Any]]:
    """The server's side of `send`: each (name, tensor) as it arrives, until the end."""
    import torch

    while True:
        header = torch.empty(HEADER, dtype=torch.int64, device=device)
        broadcast(pg, header)
        ndim, *rest = header.tolist()
        if ndim < 0:
            return
        name = torch.empty(rest[-1], dtype=torch.uint8, device=device)
        broadcast(pg, name)
        value = torch.empty(rest[:ndim], dtype=getattr(torch, DTYPES[rest[-2]]), device=device)
        broadcast(pg, value)
        yield bytes(name.tolist()).decode(), value
