"""The header reader (nbl_gguf.gguf_header) against gguf-py's GGUFReader: the same keys, values, value types
and tensor entries on the embedded model's GGUF and on files written with every value type, both byte
orders; a cut file is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from nbl_gguf.errors import NblError
from nbl_gguf.gguf.metadata import open_gguf
from nbl_gguf.gguf_header import read_header


def assert_same_as_gguf_py(path) -> None:
    import gguf

    header, reader = read_header(path), gguf.GGUFReader(path)
    assert list(header.fields) == list(reader.fields)
    for key, field in reader.fields.items():
        ours, theirs = header.fields[key].contents(), field.contents()
        assert type(ours) is type(theirs) and ours == theirs, key
        assert list(header.fields[key].types) == [int(t) for t in field.types], key
    assert header.alignment == reader.alignment
    assert [(t.name, t.shape, t.tensor_type, t.n_elements, t.n_bytes, t.data_offset) for t in header.tensors] == \
        [(t.name, tuple(int(n) for n in t.shape), t.tensor_type, int(t.n_elements), int(t.n_bytes), int(t.data_offset))
         for t in reader.tensors]


def test_the_embedded_models_header_reads_as_gguf_py_reads_it():
    from nbl_gguf import models

    path = models.embedded_gguf_path()
    assert_same_as_gguf_py(path)
    header = read_header(path)
    assert len(header.fields["tokenizer.ggml.tokens"].contents()) == 49152  # the vocabulary, every string


def write_every_type(path, endianess) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.15625)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "fünf")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_key_value("t.bools", [True, False, True], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    writer.add_array("t.strings", ["a", "", "ünï"])
    writer.add_array("t.none", [])
    writer.add_custom_alignment(64)
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 5), dtype=np.float16))
    writer.add_tensor("c.bias", np.zeros(7, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("order", ["little", "big"])
def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path, order):
    import gguf

    path = tmp_path / "types.gguf"
    write_every_type(path, gguf.GGUFEndian.LITTLE if order == "little" else gguf.GGUFEndian.BIG)
    assert_same_as_gguf_py(path)
    header = read_header(path)
    assert header.endianess == ("<" if order == "little" else ">")
    assert header.fields["t.u64"].contents() == 2**63 + 5 and header.fields["t.str"].contents() == "fünf"
    assert header.fields["t.bools"].contents() == [True, False, True]
    assert header.alignment == 64 and all(t.data_offset % 64 == 0 for t in header.tensors)


def test_a_cut_file_is_refused_by_name(tmp_path):
    import gguf

    whole = tmp_path / "whole.gguf"
    write_every_type(whole, gguf.GGUFEndian.LITTLE)
    data = whole.read_bytes()
    first = read_header(whole).tensors[0].data_offset
    for name, size in (("in-the-keys.gguf", 60), ("in-the-data.gguf", first + 8), ("no-version.gguf", 6)):
        cut = tmp_path / name
        cut.write_bytes(data[:size])
        with pytest.raises(NblError, match=rf"{name} is truncated"):
            open_gguf(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"GGML" + data[4:])
    with pytest.raises(NblError, match="does not start with the GGUF magic"):
        open_gguf(foreign)


def with_value_replaced(tmp_path, key: str, value: bytes, name: str):
    """A copy of the every-type file (little-endian) whose value of ``key`` starts with ``value`` instead, as
    ``name``; the original value's first bytes too."""
    import gguf

    whole = tmp_path / "whole.gguf"
    write_every_type(whole, gguf.GGUFEndian.LITTLE)
    data = bytearray(whole.read_bytes())
    at = data.index(key.encode()) + len(key) + 4  # the value, after the key and its type
    original = bytes(data[at:at + len(value)])
    data[at:at + len(value)] = value
    (tmp_path / name).write_bytes(bytes(data))
    return tmp_path / name, original


def test_a_damaged_length_is_refused_not_read(tmp_path):
    # a string length far beyond the file: a read of it would try to allocate it
    damaged, _ = with_value_replaced(tmp_path, "t.str", (2**62).to_bytes(8, "little"), "damaged.gguf")
    with pytest.raises(NblError, match="damaged.gguf is truncated"):
        open_gguf(damaged)


def test_an_alignment_llama_cpp_refuses_is_refused(tmp_path):
    for alignment in (0, 48):
        damaged, original = with_value_replaced(tmp_path, "general.alignment", alignment.to_bytes(4, "little"),
                                                f"aligned-{alignment}.gguf")
        assert int.from_bytes(original, "little") == 64
        with pytest.raises(NblError, match=rf"aligned-{alignment}.gguf is not a readable GGUF file.*"
                                           rf"general.alignment {alignment} is not a power of two"):
            open_gguf(damaged)
