"""Load GGUF files the way the fuzz harness does, through the regular (unsanitized) build:

    LLAMA_CPP_LIB_PATH=build/bin .venv/bin/python fuzz/replay.py FILE...

For each file, llama_model_load_from_file with default parameters; when the model loads, a 64-token
context and a decode of two tokens. One JSON line per file on stdout:
{"file", "loaded", "error" (llama.cpp's "error loading model" message), "context", "decode"}, each
preceded by {"file", "begin": true}, so that a process killed by a signal names the file it died on.
tests/test_fuzz_regressions.py runs this over the seeds and fuzz/regressions/.
"""

from __future__ import annotations

import ctypes
import json
import sys


def main(paths: list[str]) -> int:
    import llama_cpp

    log: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        log.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()

    for path in paths:
        print(json.dumps({"file": path, "begin": True}), flush=True)
        log.clear()
        result = {"file": path, "loaded": False, "error": None, "context": False, "decode": None}
        model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not model:
            errors = [line.split("error loading model:", 1)[1].strip() for line in "".join(log).splitlines()
                      if "error loading model:" in line]
            result["error"] = errors[0] if errors else None
        else:
            result["loaded"] = True
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 64, 16, 16, 1
            params.n_threads = params.n_threads_batch = 1
            ctx = llama_cpp.llama_init_from_model(model, params)
            if ctx:
                result["context"] = True
                n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
                tokens = (llama_cpp.llama_token * 2)(1 % n_vocab, 3 % n_vocab)
                result["decode"] = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 2))
                llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
