"""Hooks, apply_nbl and the end-to-end calibrate command on tiny random Llama models."""

import shutil

import numpy as np
import pytest
import torch

from _calibrate_helpers import run_calibrate, sample_texts, tiny_model, word_tokenizer, write_checkpoint
from nbl_gguf.calibration.apply import ATTN_DROP, ATTN_LINEAR, BLOCK_LINEAR, KEEP, apply_nbl
from nbl_gguf.calibration.artifact import load_artifact
from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.errors import NblError
from nbl_gguf.models import get_adapter


def capture_all(model, input_ids):
    records = {"attn": {}, "block": {}}

    def on_attention(i, h, x, y):
        records["attn"].setdefault(i, []).append((h.clone(), x.clone(), y.clone()))

    def on_block(i, h, out):
        records["block"].setdefault(i, []).append((h.clone(), out.clone()))

    with torch.no_grad(), capture_activations(model, get_adapter(model), on_attention, on_block):
        logits = model(input_ids).logits
    return records, logits


def test_every_layer_is_captured_once_per_forward_and_hooks_are_removed():
    model = tiny_model(layers=4)
    ids = torch.randint(0, 97, (2, 16))
    records, _ = capture_all(model, ids)
    assert sorted(records["attn"]) == sorted(records["block"]) == [0, 1, 2, 3]
    assert all(len(v) == 1 for v in records["attn"].values())
    assert all(len(v) == 1 for v in records["block"].values())
    # The captured tensors are the real ones: x is the layer's input norm of h, block i feeds block i+1.
    for i in range(4):
        h, x, _ = records["attn"][i][0]
        torch.testing.assert_close(x, model.model.layers[i].input_layernorm(h))
        if i:
            torch.testing.assert_close(h, records["block"][i - 1][0][1])
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_hooks_are_removed_when_the_forward_fails():
    model = tiny_model(layers=2)

    def boom(*args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with capture_activations(model, get_adapter(model), boom, None):
            model(torch.randint(0, 97, (1, 4)))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def random_linear(d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d, d, generator=g) / d**0.5).numpy(), torch.randn(d, generator=g).numpy()


def test_apply_nbl_attention_linear_drop_and_block_outputs():
    model = tiny_model(layers=4)
    ids = torch.randint(0, 97, (2, 12))
    linear = {0: random_linear(32, 1), 3: random_linear(32, 2)}
    apply_nbl(model, [ATTN_LINEAR, ATTN_DROP, KEEP, BLOCK_LINEAR], linear)
    records, _ = capture_all(model, ids)
    h, x, y = records["attn"][0][0]
    w, b = (torch.from_numpy(a) for a in linear[0])
    torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-5)  # attention -> W x + b
    assert torch.count_nonzero(records["attn"][1][0][2]) == 0  # dropped attention -> 0
    h3, out3 = records["block"][3][0]
    w, b = (torch.from_numpy(a) for a in linear[3])
    torch.testing.assert_close(out3, h3 @ w.T + b, rtol=1e-5, atol=1e-5)  # whole layer -> W h + b
    assert 3 not in records["attn"]  # the block's attention no longer runs
    # A dropped layer is exactly h + MLP(norm2(h)).
    layer1 = model.model.layers[1]
    h1, out1 = records["block"][1][0]
    torch.testing.assert_close(out1, h1 + layer1.mlp(layer1.post_attention_layernorm(h1)))


def test_apply_nbl_generation_with_kv_cache_matches_full_recompute():
    # Linear layers keep no KV, yet layer 0's cache must still count positions for the others.
    model = tiny_model(layers=3)
    apply_nbl(model, {0: ATTN_LINEAR, 2: BLOCK_LINEAR}, {0: random_linear(32, 3), 2: random_linear(32, 4)})
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        full = ids
        for _ in range(6):
            nxt = model(full, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            full = torch.cat([full, nxt], dim=1)
    assert torch.equal(cached, full)


def test_apply_nbl_rejects_bad_layer_maps():
    model = tiny_model(layers=2)
    with pytest.raises(NblError, match="layer_types has 3 entries but the model has 2 layers"):
        apply_nbl(model, [0, 0, 0])
    with pytest.raises(NblError, match="layer 1 needs linear weights"):
        apply_nbl(model, [0, ATTN_LINEAR])
    with pytest.raises(NblError, match="unknown layer type 9"):
        apply_nbl(model, {0: 9})


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(NblError, match=r"unsupported architecture 'gpt2'; supported model_type values: "
                                       r"gemma2, gemma3, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen3, smollm3$"):
        get_adapter(GPT2Config())


# --- end-to-end: the calibrate command on a saved tiny model ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("calib"), layers=3, texts=60, words=40)


def test_calibrate_end_to_end_artifact(tiny_checkpoint):
    out = tiny_checkpoint / "artifact"
    assert run_calibrate("--model", tiny_checkpoint / "model", "--dataset", tiny_checkpoint / "data.jsonl",
                         "--nsamples", 8, "--seqlen", 32, "--batch-size", 3, "--m", 1, "-o", out) == 0
    art = load_artifact(out)
    report = art.report
    assert (out / "scores.png").stat().st_size > 1000
    assert report["model"]["num_layers"] == 3 and report["model"]["hidden_size"] == 32
    assert report["data"]["tokens"] == 8 * 32 == report["statistics"]["tokens_per_layer"]
    assert len(report["data"]["sha256"]) == 64
    kv = report["selection"].pop("kv_cache")
    assert report["selection"] == {"method": "attn-nbl", "criterion": "cosine", "m": 1,
                                   "layers": art.select(), "taps": 1}
    # no sliding window: replacing 1 of 3 layers frees a third of the cache at any context
    assert kv["stock"]["caches"]["global"]["layers"] == 3 and kv["nbl"]["caches"]["global"]["layers"] == 2
    assert 3 * kv["nbl"]["bytes"] == 2 * kv["stock"]["bytes"] > 0
    assert set(report["timings_s"]) >= {"load_model", "load_data", "layers"}  # streamed: per layer
    assert set(report["resources"]["layers"]) >= {"wall_s", "peak_rss_bytes"}
    assert report["statistics"]["streamed"] and len(report["statistics"]["stream"]["per_layer_s"]) == 3
    for target in ("attn", "block"):
        for criterion in ("cca", "nmse", "cosine"):
            assert np.isfinite(art.scores(criterion, target)).all()
    assert art.select(1) == [int(np.argmin(art.scores("cosine", "attn")))]
    assert art.select(1, "cca") == [int(np.argmin(art.scores("cca", "attn")))]
    assert art.layer_types(2, "nmse", "attn-drop").count(ATTN_DROP) == 2

    # The stored maps are the LMMSE fits of the captured activations (independent numpy solve).
    model = tiny_model(layers=3, vocab=len(word_tokenizer(sample_texts(60, 40))))
    from nbl_gguf.calibration.dataset import iter_texts, build_windows
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint / "model")
    windows = build_windows(tok, iter_texts(str(tiny_checkpoint / "data.jsonl")), 8, 32).input_ids
    records, _ = capture_all(model, windows)
    _, x, y = records["attn"][1][0]
    x, y = x.reshape(-1, 32).double().numpy(), y.reshape(-1, 32).double().numpy()
    coef, *_ = np.linalg.lstsq(np.hstack([x, np.ones((len(x), 1))]), y, rcond=None)
    w, b = art.linear(1, "attn")
    assert w.dtype == np.float32 and w.shape == (32, 32) and b.shape == (32,)
    np.testing.assert_allclose(w, coef[:-1].T, atol=1e-4)
    np.testing.assert_allclose(b, coef[-1], atol=1e-4)
    # the bias-free map is least squares without intercept on the same activations
    coef0, *_ = np.linalg.lstsq(x, y, rcond=None)
    w0 = art.linear_without_bias(1)
    assert w0.dtype == np.float32 and w0.shape == (32, 32)
    np.testing.assert_allclose(w0, coef0.T, atol=1e-4)
    residual = y - x @ coef0
    assert report["layers"][1]["attn"]["nmse_nobias"] == pytest.approx(
        np.sum(residual**2) / np.sum((y - y.mean(0)) ** 2), rel=1e-4)
    assert report["layers"][1]["attn"]["nmse_nobias"] >= report["layers"][1]["attn"]["nmse"]

    # an artifact from before the bias-free maps: the error says what to rerun
    old = type(art)(art.path, art.report, {k: v for k, v in art.tensors.items() if "nobias" not in k})
    with pytest.raises(NblError, match=r"has no bias-free attention maps \(attn.1.weight_nobias\).*run calibrate again"):
        old.linear_without_bias(1)

    # And the reference model built from the artifact reproduces W x + b in that layer.
    apply_nbl(model, art.layer_types(), art)
    records, _ = capture_all(model, windows[:1])
    chosen = art.select()[0]
    _, xc, yc = records["attn"][chosen][0]
    wc, bc = art.linear(chosen)
    torch.testing.assert_close(yc, xc @ torch.from_numpy(wc).T + torch.from_numpy(bc), rtol=1e-5, atol=1e-5)


def test_attention_only_calibration_has_the_same_attention_fits(tiny_checkpoint):
    from safetensors.numpy import load_file

    common = ("--model", tiny_checkpoint / "model", "--dataset", tiny_checkpoint / "data.jsonl",
              "--nsamples", 6, "--seqlen", 32, "--m", 1)
    full, attn_only = tiny_checkpoint / "full", tiny_checkpoint / "attn-only"
    assert run_calibrate(*common, "-o", full) == 0
    assert run_calibrate(*common, "--targets", "attn", "-o", attn_only) == 0

    full_tensors, attn_tensors = load_file(str(full / "nbl.safetensors")), load_file(str(attn_only / "nbl.safetensors"))
    assert set(attn_tensors) == {k for k in full_tensors if k.startswith("attn.")}
    for key, value in attn_tensors.items():  # the block hooks change nothing of the attention sums
        np.testing.assert_array_equal(value, full_tensors[key], err_msg=key)
    art, full_art = load_artifact(attn_only), load_artifact(full)
    assert art.targets == ("attn",) and set(art.report["ranking"]) == {"attn"}
    assert art.select() == full_art.select()
    np.testing.assert_array_equal(art.scores("cosine", "attn"), full_art.scores("cosine", "attn"))
    with pytest.raises(NblError, match="has no block statistics: run calibrate again with --targets attn,block"):
        art.linear(0, "block")
    with pytest.raises(NblError, match="has no block statistics"):
        art.select(1, "cca", "block-nbl")


def test_targets_argument_errors(tiny_checkpoint):
    common = ("--model", tiny_checkpoint / "model", "--dataset", tiny_checkpoint / "data.jsonl",
              "--nsamples", 2, "--seqlen", 32, "-o", tiny_checkpoint / "never")
    with pytest.raises(NblError, match="--method block-nbl needs the block statistics"):
        run_calibrate(*common, "--targets", "attn", "--method", "block-nbl")
    for bad in ("block", "attn,mlp"):
        with pytest.raises(NblError, match="use 'attn' or 'attn,block'"):
            run_calibrate(*common, "--targets", bad)
    assert not (tiny_checkpoint / "never").exists()


def test_calibrate_user_errors(tiny_checkpoint):
    model, data = tiny_checkpoint / "model", tiny_checkpoint / "data.jsonl"
    with pytest.raises(NblError, match="--m 4 is out of range: the model has 3 layers"):
        run_calibrate("--model", model, "--dataset", data, "--m", 4, "--nsamples", 2, "--seqlen", 16)
    with pytest.raises(NblError, match="only 16 calibration tokens for hidden size 32"):
        run_calibrate("--model", model, "--dataset", data, "--nsamples", 1, "--seqlen", 16, "-o",
                      tiny_checkpoint / "x")
    empty = tiny_checkpoint / "empty.json"
    empty.write_text("[]")
    with pytest.raises(NblError, match="contains no text"):
        run_calibrate("--model", model, "--dataset", empty, "-o", tiny_checkpoint / "x")


def test_a_pytorch_checkpoint_calibrates_like_its_safetensors(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """A folder with only pytorch_model.bin cannot be read a tensor at a time: transformers loads it and
    the engine streams its layers from memory (weights.ResidentSource), with the same maps. The
    deprecated --whole-model says that it changes nothing, and changes nothing."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_checkpoint / "model", tmp_path / "pickled", ignore=shutil.ignore_patterns("*.safetensors"))
    # as checkpoints before safetensors were saved (transformers 5 writes safetensors only)
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_checkpoint / "model").state_dict(),
               tmp_path / "pickled" / "pytorch_model.bin")
    assert (tmp_path / "pickled" / "pytorch_model.bin").is_file()
    assert not list((tmp_path / "pickled").glob("*.safetensors"))
    common = ["--dataset", tiny_checkpoint / "data.jsonl", "--nsamples", 8, "--seqlen", 32, "--m", 1, "--no-progress"]
    run_calibrate("--model", tiny_checkpoint / "model", *common, "-o", tmp_path / "safetensors")
    run_calibrate("--model", tmp_path / "pickled", *common, "--whole-model", "-o", tmp_path / "pickled-art")
    assert "--whole-model is deprecated and changes nothing" in capsys.readouterr().err
    want, got = load_artifact(tmp_path / "safetensors"), load_artifact(tmp_path / "pickled-art")
    assert sorted(got.tensors) == sorted(want.tensors)
    for name in want.tensors:
        np.testing.assert_array_equal(got.tensors[name], want.tensors[name], err_msg=name)
    assert got.select() == want.select()


def test_nan_activations_abort_calibration_naming_the_layer(tiny_checkpoint, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint / "model")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
    shutil.copytree(tiny_checkpoint / "model", tmp_path / "model")  # the tokenizer; the weights replaced next
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(NblError, match=r"non-finite activations \(NaN/inf\) in layer 1 attention output"):
        run_calibrate("--model", tmp_path / "model", "--dataset", tiny_checkpoint / "data.jsonl", "--nsamples", 4,
                      "--seqlen", 16, "--m", 1, "-o", tmp_path / "out", "--no-progress")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text"])
def test_other_families_capture_and_apply(family):
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    config_cls, model_cls, extra = {"mistral": (MistralConfig, MistralForCausalLM, {}),
                                    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
                                    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 8})}[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    ids = torch.randint(0, 97, (1, 10))
    records, _ = capture_all(model, ids)
    assert sorted(records["attn"]) == [0, 1] and all(len(v) == 1 for v in records["attn"].values())
    # y is the whole contribution of the attention block to the residual stream (for Gemma: after its
    # post-attention norm): the rest of the layer applied to h + y gives the layer's output
    layer = model.model.layers[1]
    h, _, y = records["attn"][1][0]
    mid = h + y
    with torch.no_grad():
        if family == "gemma3_text":
            rest = mid + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(mid)))
        else:
            rest = mid + layer.mlp(layer.post_attention_layernorm(mid))
    torch.testing.assert_close(rest, records["block"][1][0][1], rtol=1e-5, atol=1e-5)
    apply_nbl(model, [ATTN_LINEAR, BLOCK_LINEAR], {0: random_linear(32, 5), 1: random_linear(32, 6)})
    records, _ = capture_all(model, ids)
    _, x, y = records["attn"][0][0]
    w, b = (torch.from_numpy(a) for a in random_linear(32, 5))
    torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, auto_bf16, expected", [
    (["avx512_bf16"], True, torch.bfloat16),
    (["amx_bf16", "avx512_bf16"], True, torch.bfloat16),
    ([], True, torch.float32),
    (["avx512_bf16"], False, torch.float32),
])
def test_auto_dtype_on_a_cpu_follows_its_bf16_flags_and_says_which(monkeypatch, flags, auto_bf16, expected):
    """--dtype auto on a CPU: bf16 only where the CPU has a fast bf16 path (and the default says so);
    the log names the flags found, or their absence. On CUDA: bf16; an explicit dtype is kept."""
    from nbl_gguf import models

    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(models, "CPU_AUTO_BF16", auto_bf16)
    lines = []
    assert models.resolve_dtype("auto", "cpu", lines.append) == expected
    assert models.resolve_dtype(None, "cpu") == expected
    name = "bf16" if expected == torch.bfloat16 else "fp32"
    assert lines == [f"calibration: {name} compute on the CPU (its bf16 matmuls: "
                     + (f"fast, {', '.join(flags)}" if flags else "no AMX/AVX512-BF16 flag, slow") + "; --dtype chooses)"]
    assert models.resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert models.resolve_dtype("fp32", "cpu") == torch.float32
    assert models.resolve_dtype("bf16", "cpu") == torch.bfloat16


def test_cpu_bf16_flags_are_read_from_cpuinfo(monkeypatch, tmp_path):
    from nbl_gguf import models

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    real_path = models.Path
    monkeypatch.setattr(models, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert models.cpu_bf16_flags() == ["avx512_bf16"]
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert models.cpu_bf16_flags() == []
