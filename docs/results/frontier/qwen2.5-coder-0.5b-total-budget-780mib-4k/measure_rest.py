"""The rows the interrupted `convert --total-budget 780MiB --ctx-size 4096` (Qwen2.5-Coder-0.5B) did not reach,
measured as kv_budget.measure does: llama-perplexity at 4,096 tokens, one chunk of each kind's selection text
(the run's own budget-*.txt), against stock with an F16 cache; then the passkey test at 4,096 (eval --passkey's
depths) of the leading window candidate and of the weight-type-down file."""
import json, os, time
from pathlib import Path
from nbl_gguf.llamacpp.perplexity import perplexity
from nbl_gguf.measurement.passkey import DEPTHS, longest_prompt, passkey

keep = Path("/tmp/qtb/keep")
stock = Path(os.path.expanduser("~/.cache/nbl-gguf/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"))
texts = {kind: keep / f"budget-{kind}.txt" for kind in ("c4", "prose", "code")}
rows = [("stock Q4_K_M", stock, "f16"), ("stock Q4_K_M", stock, "q4_0"),
        ("stock Q3_K_M", keep / "budget-stock-q3_k_m.gguf", "f16"),
        ("16 window layers (W = 512)", keep / "budget-w16-512.gguf", "q8_0")]

base = None
for label, path, kv in rows:
    t = time.monotonic()
    ppl = {k: perplexity(path, text, n_ctx=4096, chunks=1, threads=2, cache_type=kv).ppl for k, text in texts.items()}
    base = base or ppl
    change = sum(100 * (ppl[k] / base[k] - 1) for k in base) / len(base)
    row = {"label": label, "kv_type": kv, "ppl": ppl, "change_pct": round(change, 2), "s": round(time.monotonic() - t)}
    print(json.dumps(row), flush=True)
for label, path, kv in rows[2:]:
    t = time.monotonic()
    result = passkey(path, (longest_prompt(4096),), DEPTHS, kv_type=kv, threads=2)
    row = {"label": label, "kv_type": kv, "passkey_found": sum(tr.found for tr in result.trials), "of": len(DEPTHS),
           "s": round(time.monotonic() - t)}
    print(json.dumps(row), flush=True)
