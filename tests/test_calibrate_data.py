"""Calibration text sources and token windows."""

import json

import pytest

from _calibrate_helpers import word_tokenizer
from nbl_gguf.calibration import dataset
from nbl_gguf.errors import NblError

DOCS = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]


@pytest.fixture
def files(tmp_path):
    paths = {}
    paths["txt"] = tmp_path / "d.txt"
    paths["txt"].write_text("\n\n".join(DOCS) + "\n")
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps([{"text": t} for t in DOCS]))
    paths["json-strings"] = tmp_path / "s.json"
    paths["json-strings"].write_text(json.dumps(DOCS))
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths["parquet"] = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS, "id": [1, 2, 3]}), paths["parquet"])
    return paths


@pytest.mark.parametrize("kind", ["txt", "json", "json-strings", "jsonl", "parquet"])
def test_local_files_yield_their_documents(files, kind):
    assert list(dataset.iter_texts(str(files[kind]))) == DOCS


def test_windows_join_documents_with_eos(files):
    tok = word_tokenizer(DOCS)
    calib = dataset.build_windows(tok, dataset.iter_texts(str(files["jsonl"])), nsamples=2, seqlen=4)
    ids = calib.input_ids.tolist()
    eos = tok.eos_token_id
    words = [tok.convert_ids_to_tokens(i) for i in ids[0] + ids[1]]
    assert words == ["alpha", "beta", "gamma", "[EOS]", "delta", "epsilon", "[EOS]", "zeta"]
    assert ids[0][3] == eos and calib.nsamples == 2 and calib.tokens == 8 and calib.documents == 3
    assert len(calib.sha256) == 64


def test_fewer_windows_than_requested_are_reported_not_invented(files):
    tok = word_tokenizer(DOCS)
    calib = dataset.build_windows(tok, dataset.iter_texts(str(files["txt"])), nsamples=100, seqlen=5)
    assert calib.nsamples == 2 and calib.requested_samples == 100  # 11 tokens -> 2 full windows


def test_seqlen_is_capped_by_the_context():
    assert dataset.effective_seqlen(2048, 512) == 512
    assert dataset.effective_seqlen(256, 8192) == 256
    assert dataset.effective_seqlen(256, None) == 256


def test_empty_and_too_short_datasets_are_clear_errors(tmp_path, files):
    tok = word_tokenizer(DOCS)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(NblError, match="contains no text"):
        dataset.build_windows(tok, dataset.iter_texts(str(empty)), 4, 8, name=str(empty))
    with pytest.raises(NblError, match=r"only 11 tokens, fewer than one window of --seqlen 64"):
        dataset.build_windows(tok, dataset.iter_texts(str(files["txt"])), 4, 64)
    with pytest.raises(NblError, match="does not exist"):
        list(dataset.iter_texts(str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n")
    with pytest.raises(NblError, match="unsupported file type '.csv'"):
        list(dataset.iter_texts(str(bad)))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([{"body": "x"}]))
    with pytest.raises(NblError, match="'text' string"):
        list(dataset.iter_texts(str(wrong)))


def test_bundled_sample_split():
    calibration = list(dataset.iter_texts(None))
    heldout = dataset.heldout_texts()
    assert len(calibration) == 256 and len(heldout) == 44
    assert not set(calibration) & set(heldout)
