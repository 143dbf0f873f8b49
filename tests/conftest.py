"""Shared by the tests: the two tiers and the session's one calibration of the embedded model.

Tiers: `bash scripts/test.sh` runs every test (CI); `bash scripts/test.sh --fast` runs `-m "not slow"`.
The markers are given here at collection, by one rule (a mark written in a test file counts too):

- ``slow``: the test uses a fixture in SLOW_FIXTURES, directly or through another fixture (it
  calibrates, converts or loads a real model, the embedded SmolLM2-135M or the Qwen GGUF, or it runs
  the HF-to-GGUF converter for each of its parameters), or it is in SLOW_TESTS: the tests without such
  a fixture whose cases together took more than 10 s, setup included, in single-file `--durations=0`
  runs on the 2-core CPU while it was shared (about half its speed). A slow fixture marks every test
  that uses it, so its setup is never paid by whichever fast test comes first.
- ``llama``: the test needs the patched build: it skips itself without it (a skipif whose reason
  names scripts/build_llama.sh), or it is in a file of LLAMA_FILES, which run the build in every test.

The tiny random models take seconds, so the fast tier keeps them: it still runs nearly every module of
the package, each on a tiny model.

Workers (scripts/test.sh runs pytest-xdist with ``--dist loadgroup``): each file is one group, so its
module fixtures are made once, and the files that use a session fixture of SHARED_SESSION_FIXTURES are
one group with it. Each worker computes on its share of the cores (OpenMP and BLAS threads) and keeps its
own NBL_GGUF_CACHE below the usual one: a calibration's resume state is locked while it runs, and two
workers running the same calibration must not meet there.
"""

from __future__ import annotations

import os
import warnings

import pytest

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, str(_threads))
    from nbl_gguf.models import cache_dir

    os.environ["NBL_GGUF_CACHE"] = str(cache_dir() / f"test-worker-{_WORKER}")

SLOW_FIXTURES = {
    "embedded_calibration",  # below
    "embedded",  # test_convert_fidelity: F32 and q4_k_m NBL files of the embedded model, held-out perplexity
    "smol", "dequantized",  # test_convert_gguf_input: convert and PyTorch on the embedded Q4_1 GGUF
    "qwen_gguf",  # test_convert_gguf_input: Qwen2.5-Coder-0.5B
    "embedded_prepared",  # test_heldout_kinds: the embedded model's folder and tokenizer
    "family",  # test_convert_families: a calibration and a conversion per family
    "family_window_model",  # test_window_families: the HF-to-GGUF converter per family
    "source",  # test_convert_stock_runtime: the same per source
}

# node ids without their parameters; measured seconds, all cases together
SLOW_TESTS = {
    "tests/test_bench.py::test_bench_on_a_gguf_model_measures_the_file_and_its_surgery",  # 20
    "tests/test_calibrate_select.py::test_auto_m_is_monotone_in_the_budget_and_answers_0_when_nothing_fits",  # 19
    "tests/test_calibrate_select.py::test_auto_m_keeps_the_longest_prefix_within_the_budget",  # 24
    "tests/test_calibrate_select.py::test_best_of_picks_the_criterion_whose_set_costs_least",  # 32
    "tests/test_calibrate_select.py::test_calibrate_defaults_to_best_and_records_auto_and_greedy",  # 25
    "tests/test_calibrate_select.py::test_greedy_finds_the_set_that_exhaustive_search_finds_and_local_criteria_miss",  # 13
    "tests/test_calibrate_select.py::test_sweep_best_rows_repeat_the_choice_of_calibrate",  # 16
    "tests/test_calibrate_stream.py::test_a_disk_that_fills_up_mid_run_is_named_and_the_run_resumes",  # 23
    "tests/test_calibrate_stream.py::test_auto_and_greedy_equal_the_reference",  # 122
    "tests/test_calibrate_stream.py::test_gguf_source_reads_the_tensors_transformers_loads",  # 59
    "tests/test_calibrate_stream.py::test_hidden_states_on_disk_give_the_same_calibration",  # 20
    "tests/test_calibrate_stream.py::test_streamed_perplexities_equal_the_whole_model_for_every_layer_type",  # 16
    "tests/test_convert.py::test_convert_failure_leaves_nothing",  # 26
    "tests/test_convert.py::test_convert_quantize_failure_leaves_nothing",  # 11
    "tests/test_convert.py::test_convert_records_the_default_criterion_and_the_auto_choice",  # 246
    "tests/test_convert.py::test_convert_reuses_calibration_attn_drop_f16",  # 59
    "tests/test_convert.py::test_stock_conversion_by_pinned_converter",  # 32
    "tests/test_convert_gguf_input.py::test_calibrate_on_a_gguf_is_calibrating_its_dequantized_model",  # 112-237
    "tests/test_frontier.py::test_frontier_on_a_tiny_gguf",  # 24
    "tests/test_heldout_kinds.py::test_best_reports_the_kv_saving_of_its_layers_as_llama_cpp_allocates_it",  # 14
    "tests/test_kv_budget.py::test_convert_meets_the_budget_as_llama_cpp_allocates_it",  # 13
    "tests/test_kv_budget.py::test_convert_meets_a_total_budget_as_llama_cpp_loads_and_allocates_it",  # 12
    "tests/test_kv_budget.py::test_a_hf_models_total_budget_takes_the_weights_of_its_stock_file",  # 47-63
    "tests/test_kv_budget.py::test_a_hf_models_weight_type_down_is_quantized_from_its_float_file",  # 36 (shared)
    "tests/test_kv_budget.py::test_window_candidates_are_measured_with_their_windows",  # 11
    "tests/test_llama_window.py::test_long_prompt_then_decoding_match_the_reference",  # 24
    "tests/test_passkey.py::test_the_embedded_model_finds_the_key_and_a_narrow_window_loses_it",  # 51
    "tests/test_refine.py::test_convert_refine_writes_the_refined_maps_and_says_so",  # 70 (quiet machine)
    "tests/test_taps_convert.py::test_convert_taps_runs_in_llama_cpp_as_in_pytorch",  # 190
    "tests/test_taps_convert.py::test_streamed_taps_maps_equal_numpy_least_squares",  # 11
    "tests/test_taps_convert.py::test_taps_are_refused_for_a_graph_without_them",  # 24
    "tests/test_taps_convert.py::test_taps_need_more_fit_tokens_than_stacked_inputs",  # 20
}

# session fixtures worth making once: the files that use one run in one worker
SHARED_SESSION_FIXTURES = ("embedded_calibration",)

LLAMA_FILES = {"test_build_info.py", "test_llama_nbl.py", "test_llama_server.py", "test_rpc.py"}


@pytest.fixture(scope="session")
def embedded_calibration(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct calibrated once for the session, as `convert --model
    SmolLM2-135M-Instruct.Q4_1.gguf` calibrates it (from the file, attention only, per-token maps): 8
    windows of 256 tokens, which test_convert_gguf_input needs (a map fitted on barely more tokens than
    d = 576 is ill-conditioned) and test_convert_fidelity takes too (it needs the same maps on both
    sides, not good ones). The artifact holds every layer's maps and every criterion's scores, so each
    user picks its own m and criterion. Returns the loaded artifact."""
    from _convert_helpers import calibrate_for_convert, convert_args
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.models import embedded_gguf_path

    gguf = embedded_gguf_path()
    directory = tmp_path_factory.mktemp("embedded") / "calibration"
    return load_artifact(calibrate_for_convert(directory, gguf, convert_args(model=str(gguf), seqlen=256,
                                                                             criterion="cosine", m=8)))


def _needs_llama(item) -> bool:
    return item.path.name in LLAMA_FILES or any("build_llama.sh" in str(mark.kwargs.get("reason", ""))
                                                for mark in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    files_sharing = {}
    for item in items:
        shared = next((f for f in SHARED_SESSION_FIXTURES if f in item.fixturenames), None)
        if shared:
            files_sharing[item.path.name] = shared
    named = set()
    for item in items:
        item.add_marker(pytest.mark.xdist_group(files_sharing.get(item.path.name, item.path.name)))
        name = item.nodeid.split("[")[0]
        named.add(name)
        if SLOW_FIXTURES.intersection(item.fixturenames) or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if _needs_llama(item):
            item.add_marker(pytest.mark.llama)
    # a test renamed or removed leaves its entry behind; say so where its file was collected
    files = {item.nodeid.split("::")[0] for item in items}
    for stale in sorted(name for name in SLOW_TESTS - named if name.split("::")[0] in files):
        warnings.warn(pytest.PytestWarning(f"tests/conftest.py SLOW_TESTS names {stale}, which is not collected"))
