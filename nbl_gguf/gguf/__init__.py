"""GGUF writing and reading: the NBL format (nbl_format), the stock conversion by llama.cpp's
converter (hf_to_gguf), quantize, and the `convert` and `inspect` commands. Imports calibration,
models and llamacpp, never measurement."""
