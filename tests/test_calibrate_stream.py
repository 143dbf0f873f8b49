"""The calibration engine (layer-streamed) against its independent reference, the whole model run at
once with every fit and score computed in float64 numpy (tests/_engine_reference.py): maps, scores
and the held-out losses of the chosen layers, for every supported family and the embedded model read
from its GGUF; its memory plan, its resume after a kill, its disk errors."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _calibrate_helpers import sample_texts, tiny_model, word_tokenizer
from _engine_reference import assert_fits_match, assert_selection_matches, layer_activations
from _family_helpers import FAMILIES, random_family_model
from nbl_gguf.commands import calibrate
from nbl_gguf.calibration.artifact import CRITERIA, load_artifact
from nbl_gguf.errors import NblError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own resume states."""
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))


def run_calibrate(*argv):
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return calibrate.run(parser.parse_args([str(a) for a in argv] + ["--no-progress"]))


def assert_same_calibration(got, want, tolerance=1e-6):
    """Two calibrations of the same model and settings: every tensor within ``tolerance`` (relative to
    its largest value), every score likewise, the same selection; returns the largest relative
    difference seen."""
    assert sorted(got.tensors) == sorted(want.tensors)
    worst = 0.0
    for name in want.tensors:
        a, b = got.tensors[name], want.tensors[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    assert worst < tolerance
    for a, b in zip(got.report["layers"], want.report["layers"]):
        for target in got.targets:
            for criterion in CRITERIA + ("nmse_nobias",) if target == "attn" else CRITERIA:
                assert a[target][criterion] == pytest.approx(b[target][criterion], rel=tolerance, abs=1e-12)
    # the block influence (1 - cos of a block's input and output), recorded for every layer
    if "block" in want.targets:
        np.testing.assert_allclose(got.block_influence(), want.block_influence(), rtol=tolerance, atol=1e-12)
    sa, sb = got.report["selection"], want.report["selection"]
    assert sa["layers"] == sb["layers"] and sa.get("chosen") == sb.get("chosen")
    if "heldout" in sb:
        assert sa["heldout"]["order"] == sb["heldout"]["order"]
        np.testing.assert_allclose(sa["heldout"]["ppl"], sb["heldout"]["ppl"], rtol=tolerance)
        assert sa["heldout"]["base_ppl"] == pytest.approx(sb["heldout"]["base_ppl"], rel=tolerance)
    return worst


def calibration_windows(folder, text, nsamples: int, seqlen: int, held: int = 0):
    """(fit windows, held-out windows) as calibrate cuts them from ``text`` with --selection-text
    calibration: the held-out windows follow the fit windows."""
    from transformers import AutoTokenizer

    from nbl_gguf.calibration.dataset import load_calibration

    ids = load_calibration(AutoTokenizer.from_pretrained(folder), str(text) if text else None, nsamples + held,
                           seqlen).input_ids
    return ids[:nsamples], ids[nsamples:nsamples + held]


def assert_engine_matches_reference(artifact, model, fit_ids, heldout_ids, tolerance=1e-4):
    from nbl_gguf.calibration.apply import ATTN_DROP, ATTN_LINEAR

    assert_fits_match(artifact, layer_activations(model, fit_ids), tolerance)
    if heldout_ids is not None and len(heldout_ids):
        layer_type = ATTN_DROP if artifact.report["selection"]["method"] == "attn-drop" else ATTN_LINEAR
        assert_selection_matches(artifact, model, heldout_ids, layer_type)


# --- every family, from HF folders ------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    from nbl_gguf.calibration.dataset import heldout_texts

    path = tmp_path_factory.mktemp("text") / "text.json"
    path.write_text(json.dumps(heldout_texts()), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_equals_the_numpy_reference_for_every_family(family, tmp_path, calibration_text):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    folder = tmp_path / family
    random_family_model(family, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # best measures the three local choices on held-out windows: the streamed evaluator runs them
    run_calibrate("--model", folder, "--dataset", calibration_text, "--nsamples", 5, "--seqlen", 64, "--batch-size", 2,
                  "--selection-windows", 16, "--selection-text", "calibration", "--m", 2, "--dtype", "fp32",
                  "--targets", "attn,block", "-o", tmp_path / "artifact")
    artifact = load_artifact(tmp_path / "artifact")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fit_ids, heldout_ids = calibration_windows(folder, calibration_text, 5, 64, 16)
    assert_engine_matches_reference(artifact, model, fit_ids, heldout_ids)
    selection = artifact.report["selection"]
    compared = selection["heldout"]["compared"]
    assert selection["chosen"] == min(compared, key=lambda c: compared[c]["ppl_increase_pct"])


def test_auto_and_greedy_equal_the_reference(tmp_path, calibration_text):
    """--m auto walks prefixes in chunks and greedy measures candidates side by side: the streamed
    evaluator forks hidden-state tracks for both, and each loss it records is the whole model's."""
    from transformers import AutoTokenizer

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    folder = tmp_path / "llama"
    model = tiny_model(layers=6, hidden=48, vocab=len(tokenizer), seed=3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    common = ["--model", folder, "--dataset", calibration_text, "--nsamples", 4, "--seqlen", 64,
              "--selection-windows", 16, "--selection-text", "calibration", "--dtype", "fp32", "--targets", "attn"]
    fit_ids, heldout_ids = calibration_windows(folder, calibration_text, 4, 64, 16)
    activations = layer_activations(model, fit_ids)
    for name, extra in (("auto", ["--m", "auto", "--max-ppl-increase", 3]), ("greedy", ["--criterion", "greedy", "--m", 3])):
        run_calibrate(*common, *extra, "-o", tmp_path / name)
        artifact = load_artifact(tmp_path / name)
        assert_fits_match(artifact, activations, 1e-4)
        assert_selection_matches(artifact, model, heldout_ids, 1)
        assert artifact.report["selection"]["heldout"]["order"], name


# --- the embedded model, streamed from its GGUF -------------------------------------------------------

@pytest.mark.slow
def test_embedded_gguf_calibration_equals_the_reference(tmp_path):
    """Streaming from the GGUF (per-tensor reads, ggml's dequantization, transformers' tensor
    processing) gives the fits of the whole model that transformers dequantizes from the same file."""
    from transformers import AutoModelForCausalLM

    from nbl_gguf import models

    gguf = models.embedded_gguf_path()
    run_calibrate("--model", gguf, "--nsamples", 8, "--seqlen", 128, "--m", 4, "--criterion", "cosine",
                  "--dtype", "fp32", "--targets", "attn", "-o", tmp_path / "artifact")
    artifact = load_artifact(tmp_path / "artifact")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    fit_ids, _ = calibration_windows(models.default_model_dir(), None, 8, 128)
    assert_engine_matches_reference(artifact, model, fit_ids, None, tolerance=1e-3)
    import hashlib

    assert artifact.report["model"]["gguf"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()


def test_gguf_source_reads_the_tensors_transformers_loads():
    """Every parameter of a layer, the embedding rows and the head, as transformers' GGUF loader
    (its dequantization and Q/K un-permutation) gives them for the whole file."""
    from transformers import AutoModelForCausalLM

    from nbl_gguf import models
    from nbl_gguf.calibration.stream import load_config_and_tokenizer
    from nbl_gguf.calibration.weights import GgufSource, skeleton
    from nbl_gguf.model_source import resolve_model

    gguf = models.embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(models.default_model_dir(), dtype=torch.float32).state_dict()
    config, _ = load_config_and_tokenizer(resolve_model(str(gguf)))
    model = skeleton(config, torch.float32)
    source = GgufSource(model, gguf)
    for name in [n for n in reference if n.startswith("model.layers.5.")] + ["model.norm.weight"]:
        torch.testing.assert_close(source.parameter(name, torch.float32), reference[name], rtol=0, atol=0)
    rows = torch.tensor([0, 7, 300, 49151])
    torch.testing.assert_close(source.embedding_rows("model.embed_tokens.weight", rows, torch.float32),
                               reference["model.embed_tokens.weight"][rows], rtol=0, atol=0)
    # the head is tied to the embedding: the file stores the matrix once
    torch.testing.assert_close(source.matrix("lm_head.weight", torch.float32), reference["lm_head.weight"],
                               rtol=0, atol=0)


# --- memory plan -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    texts = sample_texts(300, 60, seed=1)
    tokenizer = word_tokenizer(texts)
    model = tiny_model(layers=8, hidden=32, vocab=len(tokenizer), seed=1)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


def tiny_args(root):
    # on the CPU: --memory-budget is host memory, and on a GPU machine the layer and the windows go to the GPU
    return ["--model", root / "model", "--dataset", root / "data.jsonl", "--nsamples", 24, "--seqlen", 64,
            "--batch-size", 3, "--selection-windows", 16, "--m", 3, "--dtype", "fp32", "--targets", "attn",
            "--device", "cpu"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from Linux's /proc")
def test_freed_heap_memory_is_handed_back_before_the_next_stage():
    """256 MiB of small blocks freed with one block after them still alive (as a finished calibration
    leaves its heap): release_freed_memory brings the resident set back to within 64 MiB of where it
    was before them, whatever the allocator kept."""
    from nbl_gguf.calibration.settings import release_freed_memory
    from nbl_gguf.usage import current_rss_bytes

    release_freed_memory()
    before = current_rss_bytes()
    blocks = [np.ones(16_000) for _ in range(2_048)]  # 128 kB each: below glibc's mmap threshold, in its heap
    allocated = current_rss_bytes()
    assert allocated - before > 200 * 2**20
    del blocks[:-1]  # the last one stays, as later allocations do, so the heap's top cannot shrink
    kept = current_rss_bytes()
    release_freed_memory()
    released = current_rss_bytes()
    assert released - before < 64 * 2**20, (before, allocated, kept, released)
    del blocks


def test_a_budget_below_one_layer_is_refused_before_any_work(tiny_folder, tmp_path):
    with pytest.raises(NblError, match=r"--memory-budget .* cannot hold one layer of model: it needs about .* GiB "
                                       r"\(the layer's weights"):
        run_calibrate(*tiny_args(tiny_folder), "--memory-budget", 1e-6, "-o", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").glob("calibration-state/*/*.bin"))


def test_hidden_states_on_disk_give_the_same_calibration(tiny_folder, tmp_path, capsys):
    """A budget that holds one layer but not the windows' hidden states puts them in files."""
    from nbl_gguf.calibration.memory_plan import plan_hidden
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    stream = LayerStream(resolve_model(str(tiny_folder / "model")), torch.float32, "cpu")
    fits = plan_hidden(stream, 24, 64, 16, 3, ("attn",), None)
    assert fits.memory == "cpu"
    disk_budget = (fits.fixed + fits.hidden // 2) / 2**30
    run_calibrate(*tiny_args(tiny_folder), "--memory-budget", disk_budget, "-o", tmp_path / "disk")
    assert "hidden states on disk" in capsys.readouterr().err
    run_calibrate(*tiny_args(tiny_folder), "-o", tmp_path / "memory")
    disk, memory = load_artifact(tmp_path / "disk"), load_artifact(tmp_path / "memory")
    assert disk.report["statistics"]["hidden_states"].startswith("hidden states on disk")
    assert assert_same_calibration(disk, memory, tolerance=1e-12) == 0.0


def test_on_a_gpu_hidden_states_spill_to_host_memory_then_to_disk(tiny_folder, monkeypatch):
    """On CUDA the windows' hidden states stay on the GPU when they fit beside one layer (in 90% of its
    free memory), else they spill to host memory within the budget (which then holds no layer), else to
    disk; a GPU that cannot hold one layer is an error that names what it needs. The GPU is simulated:
    the plan reads only torch.cuda.mem_get_info (the run itself moves each batch to the layer's device)."""
    from nbl_gguf.calibration.memory_plan import plan_hidden
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    stream = LayerStream(resolve_model(str(tiny_folder / "model")), torch.float32, "cpu")
    host = plan_hidden(stream, 24, 64, 16, 3, ("attn",), None)
    assert host.memory == "cpu" and host.fixed > 0 and host.hidden > 0
    stream.device = "cuda:0"
    free = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 1 << 40))

    def plan(budget):
        return plan_hidden(stream, 24, 64, 16, 3, ("attn",), budget)

    free["bytes"] = int((host.fixed + host.hidden) / 0.9) + 1024
    on_gpu = plan(None)
    assert on_gpu.memory == "cuda:0" and (on_gpu.fixed, on_gpu.hidden) == (host.fixed, host.hidden)
    free["bytes"] = host.fixed + host.hidden // 2  # one layer fits, the hidden states do not
    spilled = plan(host.hidden)
    assert spilled.memory == "cpu" and spilled.fixed == 0 and spilled.reason.startswith("hidden states in memory")
    on_disk = plan(host.hidden - 1)
    assert on_disk.memory is None and on_disk.reason.startswith("hidden states on disk")
    free["bytes"] = host.fixed - 1
    with pytest.raises(NblError, match=r"cuda:0 has \d+\.\d+ GiB free, and one layer of .* needs about .* GiB "
                                       r"\(the layer's weights"):
        plan(None)


@pytest.fixture(scope="module")
def gpu_folder(tmp_path_factory):
    """A model whose windows' hidden states (about 0.55 GiB) are large beside one layer (about 0.15 GiB
    with a batch's activations), so that a GPU can be filled to hold the one and not the other."""
    root = tmp_path_factory.mktemp("gpu")
    texts = sample_texts(5000, 60, seed=4)
    tokenizer = word_tokenizer(texts)
    model = tiny_model(layers=3, hidden=256, vocab=len(tokenizer), seed=4, max_position_embeddings=512)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


GPU_WINDOWS, GPU_SEQLEN, GPU_HELDOUT, GPU_BATCH = 512, 512, 16, 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_bench.sh spill runs it on one)")
def test_on_a_real_gpu_hidden_states_spill_to_host_memory_and_disk_with_the_same_calibration(gpu_folder, tmp_path):
    """A GPU with room for one layer but not for the windows' hidden states (the rest of its memory held
    by another allocation, as on a shared GPU): the layer runs on the GPU, the hidden states go to host
    memory, or to disk under a --memory-budget smaller than them, and the calibration is the one the
    GPU-resident run gives."""
    from nbl_gguf.calibration.memory_plan import plan_hidden
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    args = ["--model", gpu_folder / "model", "--dataset", gpu_folder / "data.jsonl", "--nsamples", GPU_WINDOWS,
            "--seqlen", GPU_SEQLEN, "--batch-size", GPU_BATCH, "--selection-windows", GPU_HELDOUT, "--m", 1,
            "--dtype", "fp32", "--targets", "attn", "--device", "cuda"]
    run_calibrate(*args, "-o", tmp_path / "on-gpu")
    on_gpu = load_artifact(tmp_path / "on-gpu")
    assert on_gpu.report["statistics"]["hidden_states"].startswith("hidden states on cuda")

    stream = LayerStream(resolve_model(str(gpu_folder / "model")), torch.float32, "cuda")
    plan = plan_hidden(stream, GPU_WINDOWS, GPU_SEQLEN, GPU_HELDOUT, GPU_BATCH, ("attn",), None)
    assert plan.hidden > 2 * plan.fixed  # else the margin below would not hold the run
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    ballast = torch.empty(free - (plan.fixed + plan.hidden // 2), dtype=torch.uint8, device="cuda")
    try:
        torch.cuda.reset_peak_memory_stats()
        run_calibrate(*args, "-o", tmp_path / "host")
        run_calibrate(*args, "--memory-budget", plan.hidden / 2 / 2**30, "-o", tmp_path / "disk")
        peak = torch.cuda.max_memory_allocated() - ballast.numel()
    finally:
        del ballast
        torch.cuda.empty_cache()
    host, disk = load_artifact(tmp_path / "host"), load_artifact(tmp_path / "disk")
    assert host.report["statistics"]["hidden_states"].startswith("hidden states in memory")
    assert disk.report["statistics"]["hidden_states"].startswith("hidden states on disk")
    print(f"GPU spill: hidden states {plan.hidden / 2**30:.2f} GiB, one layer {plan.fixed / 2**30:.2f} GiB planned; "
          f"free for the run {(plan.fixed + plan.hidden // 2) / 2**30:.2f} GiB; peak allocated with the ballast "
          f"{peak / 2**30:.2f} GiB; largest relative difference to the GPU-resident run: host "
          f"{assert_same_calibration(host, on_gpu):.2e}, disk {assert_same_calibration(disk, on_gpu):.2e}")


def test_a_padding_token_outside_the_calibration_text_is_no_obstacle(tmp_path):
    """The embedding module's padding index names a row of the whole vocabulary (Qwen2.5's is its last
    token): the streamed path reads only the rows its windows use, and must give the whole model's
    layer-0 input all the same."""
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    texts = sample_texts(40, 30, seed=2)
    tokenizer = word_tokenizer(texts)
    vocab = len(tokenizer) + 8
    model = tiny_model(layers=2, hidden=32, vocab=vocab, seed=2, pad_token_id=vocab - 1)
    assert model.get_input_embeddings().padding_idx == vocab - 1
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    ids = torch.randint(4, len(tokenizer), (2, 16))
    stream = LayerStream(resolve_model(str(tmp_path / "model")), torch.float32, "cpu")
    stream.prepare_embedding(ids)
    torch.testing.assert_close(stream.embed(ids), model.get_input_embeddings()(ids), rtol=0, atol=0)
    assert stream.model.get_input_embeddings().padding_idx == vocab - 1


# --- resume -----------------------------------------------------------------------------------------------

def calibrate_command(root, out, *extra):
    return [sys.executable, "-m", "nbl_gguf", "calibrate", *map(str, tiny_args(root)), "--no-progress", "-o", str(out),
            *map(str, extra)]


def state_folders(cache: Path) -> list[Path]:
    return [p for p in (cache / "calibration-state").glob("*") if p.is_dir()] if cache.is_dir() else []


def layers_done(cache: Path) -> int:
    for folder in state_folders(cache):
        try:
            return json.loads((folder / "state.json").read_text())["layers_done"]
        except (OSError, ValueError, KeyError):
            pass
    return 0


def kill_after(command, env, cache: Path, layers: int, sig=signal.SIGKILL) -> subprocess.CompletedProcess:
    """Start ``command``; once ``layers`` layers are finished, send ``sig`` (whatever it is doing then)."""
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while layers_done(cache) < layers and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_calibration_resumes_to_identical_bytes(tiny_folder, tmp_path, sig):
    env = {**os.environ, "NBL_GGUF_CACHE": str(tmp_path / "cache")}
    reference_env = {**os.environ, "NBL_GGUF_CACHE": str(tmp_path / "reference-cache")}
    subprocess.run(calibrate_command(tiny_folder, tmp_path / "reference"), env=reference_env, cwd=REPO, check=True,
                   capture_output=True)

    killed = kill_after(calibrate_command(tiny_folder, tmp_path / "out"), env, tmp_path / "cache", 3, sig)
    assert killed.returncode != 0
    assert not (tmp_path / "out").exists()
    done = layers_done(tmp_path / "cache")
    assert 3 <= done < 8
    resumed = subprocess.run(calibrate_command(tiny_folder, tmp_path / "out"), env=env, cwd=REPO, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after layer {done - 1}" in resumed.stderr
    assert (tmp_path / "out" / "nbl.safetensors").read_bytes() == (tmp_path / "reference" / "nbl.safetensors").read_bytes()
    ours, reference = (json.loads((p / "report.json").read_text()) for p in (tmp_path / "out", tmp_path / "reference"))
    assert ours["layers"] == reference["layers"] and ours["selection"] == reference["selection"]
    assert not state_folders(tmp_path / "cache")  # a finished calibration leaves no state behind


@pytest.mark.slow
def test_a_changed_input_starts_afresh_and_says_so(tiny_folder, tmp_path):
    env = {**os.environ, "NBL_GGUF_CACHE": str(tmp_path / "cache")}
    kill_after(calibrate_command(tiny_folder, tmp_path / "out"), env, tmp_path / "cache", 2)
    assert layers_done(tmp_path / "cache") >= 2
    changed = subprocess.run(calibrate_command(tiny_folder, tmp_path / "out", "--nsamples", 20), env=env, cwd=REPO,
                             capture_output=True, text=True)
    assert changed.returncode == 0, changed.stderr
    assert "was made with other inputs (tokens changed): starting afresh" in changed.stderr
    assert "resuming" not in changed.stderr
    fresh_env = {**os.environ, "NBL_GGUF_CACHE": str(tmp_path / "fresh-cache")}
    subprocess.run(calibrate_command(tiny_folder, tmp_path / "fresh", "--nsamples", 20), env=fresh_env, cwd=REPO,
                   check=True, capture_output=True)
    assert (tmp_path / "out" / "nbl.safetensors").read_bytes() == (tmp_path / "fresh" / "nbl.safetensors").read_bytes()


# --- the disk ---------------------------------------------------------------------------------------------

def test_too_little_disk_is_refused_before_the_first_layer(tiny_folder, tmp_path, monkeypatch):
    import shutil

    from nbl_gguf.calibration import resume

    real = shutil.disk_usage
    monkeypatch.setattr(resume.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(NblError, match=r"needs about .* GiB in .*calibration-state.* for its hidden states .* are free "
                                       r"\(set NBL_GGUF_CACHE"):
        run_calibrate(*tiny_args(tiny_folder), "-o", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert layers_done(tmp_path / "cache") == 0


def test_a_disk_that_fills_up_mid_run_is_named_and_the_run_resumes(tiny_folder, tmp_path, monkeypatch):
    import builtins

    from nbl_gguf.calibration import hidden

    writes = []

    class FillingFile:
        """A file whose 40th write finds the disk full."""

        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            writes.append(len(data))
            if len(writes) == 40:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def filling_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return FillingFile(handle) if "+" in mode else handle

    monkeypatch.setattr(hidden, "open", filling_open, raising=False)
    with pytest.raises(NblError, match=r"the disk of .* is full: the layer-streamed calibration keeps .* there "
                                       r"\(set NBL_GGUF_CACHE"):
        run_calibrate(*tiny_args(tiny_folder), "-o", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    done = layers_done(tmp_path / "cache")
    assert 0 < done < 8
    (state,) = state_folders(tmp_path / "cache")
    assert not list(state.glob(".*.tmp"))
    monkeypatch.undo()
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    run_calibrate(*tiny_args(tiny_folder), "-o", tmp_path / "out")
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "fresh-cache"))
    run_calibrate(*tiny_args(tiny_folder), "-o", tmp_path / "uninterrupted")
    assert_same_calibration(load_artifact(tmp_path / "out"), load_artifact(tmp_path / "uninterrupted"))


def test_artifact_writer_streams_tensors_that_safetensors_reads(tmp_path):
    from safetensors.numpy import load_file

    from nbl_gguf.calibration.artifact import LazyTensors, save_safetensors

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(7),
               "c": np.arange(3, dtype=np.int64)}
    save_safetensors(tmp_path / "x.safetensors", tensors, {"format": "test"})
    lazy = LazyTensors([tmp_path / "x.safetensors"])
    save_safetensors(tmp_path / "y.safetensors", lazy, {"format": "test"})
    for path in (tmp_path / "x.safetensors", tmp_path / "y.safetensors"):
        loaded = load_file(str(path))
        assert sorted(loaded) == sorted(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(loaded[name], value)
    assert lazy.info("a.weight") == ("F32", [5, 3])


def test_streamed_perplexities_equal_the_whole_model_for_every_layer_type(tiny_folder, tmp_path):
    """eval's PyTorch perplexity: every configuration in one streamed pass, against each configuration
    applied to the whole model and measured by torch_perplexity (the chunking of llama-perplexity)."""
    import copy

    from transformers import AutoModelForCausalLM

    from nbl_gguf.calibration.apply import ATTN_DROP, ATTN_LINEAR, BLOCK_LINEAR, apply_nbl
    from nbl_gguf.measurement.torch_ppl import streamed_perplexities, torch_perplexity
    from nbl_gguf.model_source import resolve_model

    run_calibrate(*tiny_args(tiny_folder), "--targets", "attn,block", "--criterion", "cosine", "-o", tmp_path / "art")
    artifact = load_artifact(tmp_path / "art")
    tokens = [4 + (i * 7 + i // 9) % 56 for i in range(800)]  # ids of the tiny vocabulary
    variants = {"stock": {}, "nbl": {2: ATTN_LINEAR, 5: ATTN_LINEAR}, "drop": {1: ATTN_DROP, 6: ATTN_DROP},
                "block": {3: BLOCK_LINEAR}, "mixed": {2: ATTN_LINEAR, 4: ATTN_DROP}}

    def linear(layer, kind):
        return artifact.linear(layer, "block" if kind == BLOCK_LINEAR else "attn")

    streamed = streamed_perplexities(resolve_model(str(tiny_folder / "model")), variants, linear, tokens, 64,
                                     chunks=6, bos=1, batch_size=4)
    base = AutoModelForCausalLM.from_pretrained(tiny_folder / "model", dtype=torch.float32).eval()
    for name, types in variants.items():
        model = apply_nbl(copy.deepcopy(base), types, artifact) if types else base
        want = torch_perplexity(model, tokens, 64, chunks=6, bos=1)
        assert streamed[name].ppl == pytest.approx(want.ppl, rel=1e-6), name
        assert streamed[name].error == pytest.approx(want.error, rel=1e-5) and streamed[name].chunks == 6
    assert len({round(p.ppl, 6) for p in streamed.values()}) == len(variants)  # every variant differs


def test_states_are_locked_per_key_and_stale_ones_are_removed(tmp_path, capsys):
    from nbl_gguf.calibration.resume import CalibrationState

    model = {"gguf_sha256": "ab" * 32}
    messages = []
    first = CalibrationState.for_model(model, {"tokens": "t1"}, log=messages.append)
    assert first.open() == 0
    first.save_layer(0, {"index": 0}, {"attn.0.weight": np.ones((2, 2), np.float32)})
    first.finish_layer(0)
    # the same key while it runs: refused; other inputs while it runs: side by side, nothing removed
    with pytest.raises(NblError, match="the same calibration is running already"):
        CalibrationState.for_model(model, {"tokens": "t1"}).open()
    other = CalibrationState.for_model(model, {"tokens": "t2"}, log=messages.append)
    assert other.open() == 0 and first.folder.is_dir() and not messages
    other.close(finished=False)
    first.close(finished=False)
    # the interrupted first run, resumed; then a run with other inputs removes both stale states
    again = CalibrationState.for_model(model, {"tokens": "t1"}, log=messages.append)
    assert again.open() == 1 and messages == [f"calibration: resuming after layer 0 (state {first.folder})"]
    again.close(finished=False)
    third = CalibrationState.for_model(model, {"tokens": "t3"}, log=messages.append)
    assert third.open() == 0
    assert sorted(m.split(" was made")[0] for m in messages[1:]) == sorted(
        f"calibration: the saved state in {f}" for f in (first.folder, other.folder))
    assert all("(tokens changed): starting afresh" in m for m in messages[1:])
    assert not first.folder.exists() and not other.folder.exists()
    third.close(finished=True)
    assert not third.folder.exists()


def test_a_model_s_config_and_tokenizer_are_read_once_per_process(tiny_folder, monkeypatch):
    """One convert opens the model up to four times (calibration, best at m, window layers, refinement):
    the GGUF's tokenizer, rebuilt from its vocabulary, is read once; each caller gets its own config; a
    changed folder is read again."""
    import shutil

    import transformers

    from nbl_gguf import models
    from nbl_gguf.calibration import stream as stream_module
    from nbl_gguf.model_source import resolve_model

    reads = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: reads.append(args[0]) or original(*args, **kwargs))
    monkeypatch.setattr(stream_module, "_LOADED", {})

    gguf = resolve_model(str(models.embedded_gguf_path()))
    config, tokenizer = stream_module.load_config_and_tokenizer(gguf)
    again, same_tokenizer = stream_module.load_config_and_tokenizer(gguf)
    assert len(reads) == 1 and same_tokenizer is tokenizer
    assert again is not config and again.to_dict() == config.to_dict()
    config.num_hidden_layers = 1  # a caller's change stays its own
    assert stream_module.load_config_and_tokenizer(gguf)[0].num_hidden_layers == again.num_hidden_layers == 30
    assert tokenizer("def f(x): return x")["input_ids"] == same_tokenizer("def f(x): return x")["input_ids"]

    folder = tiny_folder / "copy"
    shutil.copytree(tiny_folder / "model", folder)
    stream_module.load_config_and_tokenizer(resolve_model(str(folder)))
    stream_module.load_config_and_tokenizer(resolve_model(str(folder)))
    assert len(reads) == 2
    config_file = folder / "config.json"
    config_file.write_text(config_file.read_text().replace('"num_hidden_layers": 8', '"num_hidden_layers": 7'))
    assert stream_module.load_config_and_tokenizer(resolve_model(str(folder)))[0].num_hidden_layers == 7
    assert len(reads) == 3


def test_a_gguf_s_tensor_index_is_read_once_per_process(monkeypatch, tmp_path):
    """gguf-py parses every metadata field (the vocabulary's strings one by one) to reach the tensors: a
    second stream of the same file reads the same weights without parsing it again; another file, or
    the same path rewritten, is parsed again."""
    import shutil

    import gguf

    from nbl_gguf import models
    from nbl_gguf.calibration import stream as stream_module
    from nbl_gguf.calibration import weights as weight_io
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    parses = []
    original = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, path, *a, **k: parses.append(str(path))
                        or original(self, path, *a, **k))
    monkeypatch.setattr(weight_io, "_GGUF_INDEX", {})
    monkeypatch.setattr(stream_module, "_LOADED", {})
    source = resolve_model(str(models.embedded_gguf_path()))
    first = LayerStream(source, torch.float32, "cpu")  # transformers' config and tokenizer readers, and ours
    parsed = len(parses)
    second = LayerStream(source, torch.float32, "cpu")
    assert len(parses) == parsed
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(first.weights.parameter(name, torch.float32), second.weights.parameter(name, torch.float32))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(models.embedded_gguf_path(), copy)
    parses.clear()
    LayerStream(resolve_model(str(copy)), torch.float32, "cpu")
    # the index alone (resolve_model reads the header with gguf_header; the same content: its config and
    # tokenizer are known)
    assert parses == [str(copy)]
