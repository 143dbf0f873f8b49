"""The llama.cpp runtime: where the patched build lives and how to run its tools (tools), and loading
a GGUF in-process through llama-cpp-python (library). Bottom layer: imports only nbl_gguf.errors."""
