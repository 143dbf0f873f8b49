"""ggml's RPC backend from llama-cpp-python: the in-process counterpart of the tools' ``--rpc``.

llama-cpp-python 0.3.36 has no ``rpc_servers`` argument (``llama_model_params`` lost that field
upstream; its ``devices`` field is marked unused in the bindings), so the servers are registered as
ggml devices through ctypes, as common/arg.cpp does for ``--rpc``. A model loaded afterwards with
``n_gpu_layers`` > 0 and no device list is split over them, in the order given (llama.cpp puts RPC
devices first). Registration lasts for the process: use a process of its own for it.
"""

from __future__ import annotations

import ctypes
import socket
from pathlib import Path
from typing import Sequence

from nbl_gguf.errors import NblError

# ggml registers a server's devices anew on every ggml_backend_register: once per process each
_registered: dict[str, list[str]] = {}


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NblError(f"RPC endpoint {endpoint!r} is not host:port")
    return host, int(port)


def _ggml() -> ctypes.CDLL:
    """libggml of the libllama that llama-cpp-python loaded: the same file, so the same registry."""
    import llama_cpp

    lib_dir = Path(llama_cpp.llama_cpp._lib._name).parent
    candidates = sorted(lib_dir.glob("libggml.so*")) + sorted(lib_dir.glob("libggml.dylib"))
    if not candidates:
        raise NblError(f"no libggml next to {llama_cpp.llama_cpp._lib._name}")
    ggml = ctypes.CDLL(str(candidates[0]))
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.restype = None
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
    return ggml


def add_servers(endpoints: Sequence[str], connect_timeout: float = 5.0) -> list[str]:
    """Register ggml-rpc-server endpoints ("host:port") as devices; returns their device names
    (RPC0, RPC1, ...). Each endpoint is reached first: ggml aborts the process on one it cannot reach."""
    if not endpoints:
        raise NblError("no RPC endpoints given")
    if len(set(endpoints)) != len(endpoints):
        raise NblError(f"an RPC endpoint is given twice: {', '.join(endpoints)}")
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        try:
            socket.create_connection((host, port), timeout=connect_timeout).close()
        except OSError as error:
            raise NblError(f"RPC server {endpoint} cannot be reached: {error}") from error

    ggml = _ggml()
    rpc = ggml.ggml_backend_reg_by_name(b"RPC")
    if not rpc:
        raise NblError("this llama.cpp build has no RPC backend: rebuild with -DNBL_GGML_RPC=ON (the default)")
    address = ggml.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server")
    if not address:
        raise NblError("the RPC backend does not export ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)

    names = []
    for endpoint in endpoints:
        if endpoint not in _registered:
            reg = add_server(endpoint.encode())
            if not reg:
                raise NblError(f"RPC server {endpoint} offers no device")
            ggml.ggml_backend_register(reg)
            _registered[endpoint] = [ggml.ggml_backend_dev_name(ggml.ggml_backend_reg_dev_get(reg, i)).decode()
                                     for i in range(ggml.ggml_backend_reg_dev_count(reg))]
        names += _registered[endpoint]
    return names
