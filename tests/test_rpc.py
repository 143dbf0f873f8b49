"""An NBL GGUF split over two ggml-rpc-server processes on 127.0.0.1 (llama.cpp's RPC backend) gives
the logits of the local run and of the numpy reference; a stock GGUF, the same way, is the control.

The RPC devices are registered in-process through nbl_gguf.llamacpp.rpc (ctypes on ggml: this
llama-cpp-python has no rpc_servers argument), in a subprocess per run: a registration lasts for the
process, and ggml aborts it if a server goes away.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import rpc
from nbl_gguf.llamacpp import tools as llamacpp

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED
# six layers split 1:1 over two devices: each holds an NBL linear layer and an attention layer
TYPES = [L, A, D, A, L, A]
THREADS = 2
# the servers offer their CPU device (also in a CUDA build), so both runs execute the same ggml CPU
# kernels: measured max abs difference 0.0, with servers on 1 or 2 threads (docs/rpc.md); the bound is
# float32 rounding of these logits (1e-6 against numpy) times ten, far below what a layer evaluated
# wrongly gives (the NBL and attention forms of a layer differ by more than 0.1)
RPC_TOLERANCE = 1e-5
# against the numpy reference, as in tests/test_llama_nbl.py
REFERENCE_TOLERANCE = 1e-3
SERVER_START_S = 30
RUN_TIMEOUT_S = 120

SERVER = llamacpp.bin_dir() / "ggml-rpc-server"
pytestmark = pytest.mark.skipif(
    not SERVER.is_file(),
    reason=f"ggml-rpc-server is not built in {llamacpp.bin_dir()} (configure with -DNBL_GGML_RPC=ON, the default)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    # the server never outlives the test process, even if teardown does not run (PR_SET_PDEATHSIG)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def start_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [str(SERVER), "-d", "CPU", "-H", "127.0.0.1", "-p", str(port), "-t", str(THREADS)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    deadline = time.monotonic() + SERVER_START_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"ggml-rpc-server on port {port} did not start:\n" + process.stderr.read()[-3000:])
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers():
    processes = []
    try:
        endpoints = []
        for _ in range(2):
            port = free_port()
            processes.append(start_server(port))
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)


RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import llama_cpp
    from nbl_gguf.llamacpp import library, rpc
    path, tokens, endpoints, threads, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    devices = rpc.add_servers(endpoints) if endpoints else []
    with library.captured_log() as lines:
        llm = llama_cpp.Llama(path, n_ctx=64, logits_all=True, verbose=True, n_threads=threads, n_threads_batch=threads,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              n_gpu_layers=99 if devices else 0, tensor_split=[1.0] * len(devices) or None)
    np.save(out + ".npy", library.logits(llm, tokens))
    with open(out + ".json", "w") as f:
        json.dump({"devices": devices, "log": "".join(lines)}, f)
    """
)


def run(path, tokens, endpoints, out):
    """Logits of one causal pass, locally (no endpoints) or over the RPC servers, and the load log."""
    completed = subprocess.run(
        [sys.executable, "-c", RUN, str(path), json.dumps([int(t) for t in tokens]), json.dumps(endpoints),
         str(THREADS), str(out)],
        capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S, env=dict(os.environ),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(f"{out}.json") as f:
        info = json.load(f)
    return np.load(f"{out}.npy"), info


def layer_devices(log: str) -> dict[int, str]:
    return {int(layer): device for layer, device in re.findall(r"layer\s+(\d+) assigned to device (\S+?),", log)}


def check_split(model, info, types, endpoints):
    devices, log = info["devices"], info["log"]
    assert len(devices) == 2, devices
    placed = layer_devices(log)
    # every layer and the output layer (index n_layer) run on an RPC device, and both devices work
    assert sorted(placed) == list(range(model.n_layer + 1)), placed
    assert set(placed.values()) == set(devices), placed
    for device in devices:
        held = {types[i] for i, d in placed.items() if d == device and i < model.n_layer}
        assert A in held and (L in held or all(t == A for t in types)), (device, placed)
    # the weights went to both servers
    assert set(re.findall(r"RPC\d+\[([\d.]+:\d+)\] model buffer size", log)) == set(endpoints), log
    # the KV cache: on the device of its layer, for the attention layers only (an NBL layer has none)
    kv = dict(re.findall(r"llama_kv_cache: layer\s+(\d+): (dev = \S+|does not have KV cache)", log))
    assert kv == {str(i): f"dev = {placed[i]}" if t == A else "does not have KV cache" for i, t in enumerate(types)}, kv


def test_nbl_gguf_over_two_rpc_servers_matches_the_local_run(tmp_path, servers):
    model = TinyLlama(n_layer=len(TYPES), n_head=8, n_head_kv=2, seed=5)
    linear = model.random_linear([i for i, t in enumerate(TYPES) if t == L], seed=6)
    path = model.write_nbl_gguf(tmp_path / "nbl.gguf", TYPES, linear)
    tokens = list(np.random.default_rng(8).integers(3, model.n_vocab, size=24))

    local, _ = run(path, tokens, [], tmp_path / "local")
    remote, info = run(path, tokens, servers, tmp_path / "rpc")
    check_split(model, info, TYPES, servers)

    assert np.abs(remote - local).max() <= RPC_TOLERANCE
    want = model.forward(tokens, TYPES, linear)
    assert np.abs(remote - want).max() < REFERENCE_TOLERANCE
    # the comparison can tell the NBL layers from the attention they replaced
    assert np.abs(model.forward(tokens) - want).max() > 100 * REFERENCE_TOLERANCE


def test_stock_gguf_over_two_rpc_servers_matches_the_local_run(tmp_path, servers):
    model = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=9)
    path = model.write_gguf(tmp_path / "stock.gguf")
    tokens = list(np.random.default_rng(10).integers(3, model.n_vocab, size=24))

    local, _ = run(path, tokens, [], tmp_path / "local")
    remote, info = run(path, tokens, servers, tmp_path / "rpc")
    check_split(model, info, [A] * model.n_layer, servers)
    assert np.abs(remote - local).max() <= RPC_TOLERANCE
    assert np.abs(remote - model.forward(tokens)).max() < REFERENCE_TOLERANCE


def test_an_unreachable_server_is_named_before_ggml_is_called():
    port = free_port()  # nothing listens there
    with pytest.raises(NblError, match=rf"RPC server 127.0.0.1:{port} cannot be reached"):
        rpc.add_servers([f"127.0.0.1:{port}"], connect_timeout=1)
    with pytest.raises(NblError, match=r"'localhost' is not host:port"):
        rpc.add_servers(["localhost"])
