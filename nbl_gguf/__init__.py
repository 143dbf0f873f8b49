"""nbl-gguf: Neural Block Linearization for llama.cpp GGUF models."""

__version__ = "0.1.0"
