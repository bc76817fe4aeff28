"""FLARE's transfer of one model, measured alone: two FLARE cells in two processes on loopback, one sends the model,
the other decodes it. (Two cells of one process would not do: FLARE hands a message between them by a direct call,
without the socket; this benchmark did that until 2026-11-26, which made the transfer look 2x faster.)

This isolates FLARE 2.9's transfer path (FOBS serialisation, the ``ViaDownloaderDecomposer`` download of the arrays
in chunks, the cell's framing and acknowledgements, deserialisation) from everything else in a round (the
simulator's task polling, training, the server's work). A site cell sends a ``Shareable`` holding a ``DXO`` of the
model's arrays to a server cell as a request, the way a site's result travels (the global model's download takes
the same path in the other direction); the time is from the send to the reply, after the server has decoded every
array. Each variant is one change medflare could make to what it hands FLARE:

- ``fp32``: the state dict as medflare sends it today, one numpy array per tensor (122 for ResNet-18);
- ``fp16``: float weights narrowed to float16 (``transfer_dtype`` / ``download_dtype``);
- ``one-buffer``: every array packed into one contiguous uint8 buffer plus a small index (one item for FLARE);
- ``chunk-8mb`` / ``chunk-64mb`` / ``native``: FLARE's own setting ``np_download_chunk_size`` (default 2 MiB; 0 =
  arrays inside the message, streamed by the cell);
- ``tensors`` / ``tensors-fp16``: torch tensors instead of numpy arrays (FLARE's ``TensorDecomposer``, safetensors
  items), in float32 or float16;
- ``one-tensor``: the one contiguous buffer as a torch tensor.

Usage:
    make bench-transfer                                 # = python benchmarks/transfer.py --out runs/bench-transfer
    python benchmarks/transfer.py                       # ResNet-18, every variant, 7 repeats
    python benchmarks/transfer.py --model cnn --repeats 3 --variants fp32 one-buffer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "custom"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts (benchmarks/ is not a package)

from he_cost import free_port  # noqa: E402

VARIANTS = ("fp32", "fp16", "one-buffer", "chunk-8mb", "chunk-64mb", "native", "tensors", "tensors-fp16",
            "one-tensor")
CHUNK_VAR = "NVFLARE_NP_DOWNLOAD_CHUNK_SIZE"


def model_arrays(model: str) -> dict[str, np.ndarray]:
    """The model's state dict as numpy arrays, as a site sends it (1 channel, 28 px, 2 classes)."""
    from medflare.models import create_model

    network = create_model(model, num_classes=2, in_channels=1, image_size=28)
    return {key: value.detach().cpu().numpy().copy() for key, value in network.state_dict().items()}


def pack_one_buffer(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every array's bytes in one contiguous uint8 buffer, with the keys, dtypes and shapes in a small index."""
    index = [[key, value.dtype.str, list(value.shape)] for key, value in arrays.items()]
    buffer = np.concatenate([np.ascontiguousarray(value).reshape(-1).view(np.uint8) for value in arrays.values()])
    return {"buffer": buffer, "index": np.frombuffer(json.dumps(index).encode(), dtype=np.uint8)}


def unpack_one_buffer(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays, offset, buffer = {}, 0, packed["buffer"]
    for key, dtype, shape in json.loads(packed["index"].tobytes()):
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        arrays[key] = buffer[offset:offset + size].view(dtype).reshape(shape)
        offset += size
    return arrays


def payload_for(variant: str, arrays: dict[str, np.ndarray]) -> tuple[dict, Callable[[dict], int]]:
    """The DXO data of a variant and a function that checks what arrived (returns its byte count)."""
    if variant == "fp16":
        data = {k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in arrays.items()}
        return data, lambda got: sum(v.nbytes for v in got.values())
    if variant == "one-buffer":
        return pack_one_buffer(arrays), lambda got: sum(v.nbytes for v in unpack_one_buffer(got).values())
    if variant.startswith("tensors") or variant == "one-tensor":
        import torch

        if variant == "tensors-fp16":
            arrays = {k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in arrays.items()}
        if variant == "one-tensor":
            packed = pack_one_buffer(arrays)
            return ({"buffer": torch.from_numpy(packed["buffer"]), "index": packed["index"]},
                    lambda got: sum(v.nbytes for v in unpack_one_buffer(
                        {"buffer": got["buffer"].numpy(), "index": got["index"]}).values()))
        data = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return data, lambda got: sum(v.numel() * v.element_size() for v in got.values())
    return dict(arrays), lambda got: sum(v.nbytes for v in got.values())


def register_decomposers() -> None:
    from nvflare.apis.utils.decomposers import flare_decomposers
    from nvflare.app_common.decomposers import numpy_decomposers
    from nvflare.app_opt.pt.decomposers import TensorDecomposer
    from nvflare.fuel.utils import fobs

    flare_decomposers.register()
    numpy_decomposers.register()
    fobs.register(TensorDecomposer)


def start_cell(fqcn: str, port: int):
    """A FLARE cell on ``tcp://localhost:port`` (the server cell listens there, a site cell connects)."""
    from nvflare.fuel.f3.cellnet.cell import Cell

    cell = Cell(fqcn=fqcn, root_url=f"tcp://localhost:{port}", secure=False, credentials={},
                create_internal_listener=False)
    cell.start()
    return cell


def serve(variant: str, model: str, port: int) -> None:
    """The server cell, in a process of its own: FLARE delivers a message between two cells of one process by a
    direct call, so only cells in two processes move it through the socket and the download service, as a job
    does. It decodes every array of each result, then replies with the bytes it got; it runs until killed."""
    from nvflare.apis.dxo import from_shareable
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.fuel.f3.cellnet.utils import make_reply

    _, check = payload_for(variant, model_arrays(model))

    def on_result(request):
        return make_reply(ReturnCode.OK, body={"bytes": check(from_shareable(request.payload).data)})

    server = start_cell("server", port)
    server.register_request_cb(channel="bench", topic="result", cb=on_result)
    print("ready", flush=True)
    while True:
        time.sleep(1)


def measure(variant: str, arrays: dict[str, np.ndarray], repeats: int, port: int, model: str) -> dict:
    """Seconds from the site's send to the server's reply, after it decoded every array, over ``repeats`` sends;
    the server cell runs in a child process (:func:`serve`)."""
    import subprocess

    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.fuel.f3.cellnet.utils import new_cell_message

    data, _ = payload_for(variant, arrays)
    server = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--model", model, "--port", str(port)],
                              stdout=subprocess.PIPE, text=True)
    site = None
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{variant}: the server cell did not start")
        site = start_cell("site-1", port)
        _wait_connected(site)
        seconds, received = [], 0
        for _ in range(repeats + 1):  # the first send warms the connection and the streams up
            message = new_cell_message({}, DXO(DataKind.WEIGHTS, data=data, meta={}).to_shareable())
            start = time.perf_counter()
            reply = site.send_request(channel="bench", topic="result", target="server", request=message, timeout=120)
            seconds.append(time.perf_counter() - start)
            if reply is None or reply.get_header("return_code", "OK") != "OK":
                raise RuntimeError(f"{variant}: the server did not confirm the result: {reply and reply.headers}")
            received = reply.payload["bytes"]
        return {"variant": variant, "seconds": seconds[1:], "mean": statistics.mean(seconds[1:]),
                "stdev": statistics.pstdev(seconds[1:]), "bytes": received}
    finally:
        if site is not None:
            site.stop()
        server.kill()
        server.wait()


def _wait_connected(site, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not site.is_cell_connected("server"):
        if time.monotonic() > deadline:
            raise RuntimeError("the site cell did not connect to the server cell")
        time.sleep(0.05)


def run_variant(variant: str, model: str, repeats: int) -> dict:
    """One variant in a fresh process, so FLARE's module-level settings (the chunk size) apply from the start."""
    import subprocess

    env = dict(os.environ)
    env.pop(CHUNK_VAR, None)
    if variant.startswith("chunk-"):
        env[CHUNK_VAR] = str(int(variant[6:-2]) * 1024 * 1024)
    elif variant == "native":
        env[CHUNK_VAR] = "0"
    out = subprocess.run([sys.executable, __file__, "--one", variant, "--model", model, "--repeats", str(repeats)],
                         env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} failed: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)  # the server cell's process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="a folder for results.md and results.json")
    args = parser.parse_args()
    if args.one or args.serve:
        import logging

        logging.disable(logging.WARNING)
        register_decomposers()
        if args.serve:
            serve(args.serve, args.model, args.port)  # until the measuring process ends it
            return
        print(json.dumps(measure(args.one, model_arrays(args.model), args.repeats, free_port(), args.model)))
        return
    rows = [run_variant(variant, args.model, args.repeats) for variant in args.variants]
    table = markdown(rows, args.model, args.repeats)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(table)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")


def markdown(rows: list[dict], model: str, repeats: int) -> str:
    base = rows[0]["mean"]
    lines = [f"# FLARE's transfer of one {model} model between two cells (two processes) on loopback", "",
             f"| variant | s per transfer (mean ± sd of {repeats}) | MB/s | against {rows[0]['variant']} |",
             "|---|---|---|---|"]
    lines += [f"| {row['variant']} | {row['mean']:.3f} ± {row['stdev']:.3f} | {row['bytes'] / row['mean'] / 1e6:.0f} "
              f"| {row['mean'] / base:.2f} |" for row in rows]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
