"""A llama.cpp context on raw batches through llama-cpp-python's C API, for the tests that compare the
patched llama.cpp's logits with a reference (test_llama_taps, test_llama_cuda)."""

from __future__ import annotations

import ctypes

import numpy as np

from nbl_gguf.llamacpp import library


class Context:
    """A llama.cpp context on raw batches: (token, position, sequence) items, logits for every item."""

    def __init__(self, path, n_seq_max: int = 2, n_ctx: int = 128, n_ubatch: int = 512, n_gpu_layers: int | None = None,
                 kv_type: str = "f32", swa_full: bool = False):
        """``kv_type``: the cache type (-ctk/-ctv); F32 compares best with a float reference, and a
        quantized cache needs flash attention, which this turns on for any other type. ``swa_full``
        off, as in llama-cli (the C API's default is on): sliding-window layers cache only their window."""
        import llama_cpp

        self.lib = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = library.default_gpu_layers() if n_gpu_layers is None else n_gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        assert self.model, f"{path} did not load"
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_ctx, n_ubatch, n_seq_max
        params.n_threads = params.n_threads_batch = 2
        # "q8_0/q4_0": K's type and V's, as convert --kv-type names them
        params.type_k, params.type_v = library.ggml_cache_types(kv_type)
        # off for F32, as llama-cpp-python's Llama: the CPU kernel rounds Q to F16
        params.flash_attn_type = 0 if kv_type == "f32" else 1
        params.swa_full = swa_full
        params.op_offload = model_params.n_gpu_layers != 0  # a CPU model's large batches stay on the CPU
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        assert self.ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def decode(self, items) -> np.ndarray:
        lib = self.lib
        batch = lib.llama_batch_init(len(items), 0, 1)
        try:
            batch.n_tokens = len(items)
            for i, (token, pos, seq) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True
            assert lib.llama_decode(self.ctx, batch) == 0
            return np.array([np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                             for i in range(len(items))], dtype=np.float64)
        finally:
            lib.llama_batch_free(batch)

    def interleaved(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        """Sequences 0 and 1 from position 0, their tokens alternating in one batch: (a's logits, b's)."""
        items = []
        for i in range(max(len(a), len(b))):
            items += [(a[i], i, 0)] if i < len(a) else []
            items += [(b[i], i, 1)] if i < len(b) else []
        got = self.decode(items)
        return (got[[k for k, (_, _, s) in enumerate(items) if s == 0]],
                got[[k for k, (_, _, s) in enumerate(items) if s == 1]])

    def run(self, tokens, seq: int = 0, start: int = 0) -> np.ndarray:
        return self.decode([(t, start + i, seq) for i, t in enumerate(tokens)])

    def step(self, tokens, seq: int = 0, start: int = 0) -> np.ndarray:
        return np.concatenate([self.run([t], seq, start + i) for i, t in enumerate(tokens)])

    def seq_rm(self, seq, p0, p1) -> bool:
        return bool(self.lib.llama_memory_seq_rm(self.memory, seq, p0, p1))

    def pos_max(self, seq) -> int:
        return self.lib.llama_memory_seq_pos_max(self.memory, seq)

    def pos_min(self, seq) -> int:
        return self.lib.llama_memory_seq_pos_min(self.memory, seq)

    def save_seq(self, seq) -> bytes:
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        assert self.lib.llama_state_seq_get_data(self.ctx, buffer, size, seq) == size
        return bytes(buffer)

    def load_seq(self, data: bytes, seq) -> None:
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        assert self.lib.llama_state_seq_set_data(self.ctx, buffer, len(data), seq) == len(data)

    def close(self):
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
