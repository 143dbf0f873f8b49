"""pytest plugin for the GPU machine (scripts/gpu_bench.sh tests): it has no embedded model, so the tests
that ask for the embedded model's tokenizer get the one `gpu_bench.sh pack` put in .carry/tokenizer."""

from pathlib import Path

from nbl_gguf import models

TOKENIZER = Path(__file__).resolve().parent.parent / ".carry" / "tokenizer"
models.default_model_dir = lambda: TOKENIZER
