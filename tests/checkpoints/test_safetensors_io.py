"""The streaming safetensors writer/reader against the ``safetensors`` package (an independent reader and
writer): every dtype, any shape, both directions; truncation and size parsing."""

from __future__ import annotations

import copy
import json
import pickle
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from dbr_quant.checkpoints import CheckpointError
from dbr_quant.checkpoints.safetensors_io import (
    DTYPES,
    Entry,
    order_for_alignment,
    parse_size,
    read_header,
    read_tensor,
    write_file,
)

ALL_DTYPES = sorted(DTYPES, key=str)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g) * 100
        return x.clamp(-400, 400).to(dtype) if dtype.itemsize == 1 else x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


tensors = st.lists(
    st.tuples(st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers(0, 99)),
    min_size=1, max_size=6)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe)."""
    same_bytes = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
    return a.dtype == b.dtype and a.shape == b.shape and same_bytes


@settings(max_examples=25, deadline=None)
@given(tensors)
def test_written_files_read_by_safetensors(tmp_path_factory, specs):
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    values = {f"t{i}.w": _random(d, tuple(s), seed) for i, (d, s, seed) in enumerate(specs)}
    entries = [Entry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in values.items()]
    size = write_file(path, order_for_alignment(entries), {"format": "pt"})
    assert size == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(values)
        for n, t in values.items():
            assert _same(f.get_tensor(n), t), n
    header, _ = read_header(path)
    for n, t in values.items():  # every tensor starts at a multiple of its element size
        assert (header[n].begin - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]) % t.dtype.itemsize == 0
        assert _same(read_tensor(header[n]), t)


@settings(max_examples=15, deadline=None)
@given(tensors)
def test_reads_files_written_by_safetensors(tmp_path_factory, specs):
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    values = {f"t{i}": _random(d, tuple(s), seed) for i, (d, s, seed) in enumerate(specs)}
    save_file(values, str(path), metadata={"format": "pt"})
    header, meta = read_header(path)
    assert meta == {"format": "pt"}
    for n, t in values.items():
        assert _same(read_tensor(header[n]), t)


def test_views_and_noncontiguous_are_written_as_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows, cols = base[1:3], base[:, ::2]  # a row view of a larger storage; a strided view
    entries = [Entry("rows", torch.float32, (2, 6), lambda: rows), Entry("cols", torch.float32, (4, 3), lambda: cols)]
    write_file(tmp_path / "v.safetensors", entries, {"format": "pt"})
    with safe_open(str(tmp_path / "v.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("rows"), rows) and torch.equal(f.get_tensor("cols"), cols)


def test_produced_tensor_must_match_the_plan(tmp_path):
    with pytest.raises(CheckpointError, match="w: produced torch.float32 \\[3\\], planned torch.float32 \\[2\\]"):
        write_file(tmp_path / "x.safetensors", [Entry("w", torch.float32, (2,), lambda: torch.zeros(3))], {})


def test_truncated_file_names_the_first_tensor_past_the_end(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.ones(1000)}, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"b in .*t\.safetensors: its bytes end at \d+ but the file has"):
        read_header(path)
    path.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="the header claims"):
        read_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)


def test_inconsistent_header_is_an_error(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=r"w in .*: F32 \[3\] does not fit its byte range \[0, 8\)"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(path)


@pytest.mark.parametrize("text, value", [
    ("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("100kB", 100_000), ("1.5MiB", 1572864),
    (123, 123), ("64B", 64)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["5 parsecs", "", "-1GB", 0, -5, "GB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(bad)


def test_a_large_tensor_is_read_into_its_own_mapping_with_the_files_values(tmp_path, monkeypatch):
    """Tensors from OWN_MAPPING bytes up get an anonymous mapping of their own (unmapped when dropped: freed
    memory goes back to the OS during a load): the same values as the safetensors package reads, usable as any
    tensor (written to, pickled, copied), alive as long as a view of it is."""
    monkeypatch.setattr("dbr_quant.checkpoints.safetensors_io.OWN_MAPPING", 64)
    tensors = {"big": torch.randn(40, 30), "fp8": (torch.randn(17, 9) * 10).to(torch.float8_e4m3fn),
               "small": torch.arange(5, dtype=torch.int32)}
    save_file(tensors, tmp_path / "m.safetensors")
    headers, _ = read_header(tmp_path / "m.safetensors")
    read = {name: read_tensor(t) for name, t in headers.items()}
    for name, t in tensors.items():
        assert torch.equal(read[name].view(torch.uint8), t.view(torch.uint8)), name
    view = read.pop("big")[3:5]
    del headers
    assert torch.equal(view, tensors["big"][3:5])  # the mapping outlives the tensor it was read into
    view.add_(1)
    assert torch.equal(pickle.loads(pickle.dumps(view)), tensors["big"][3:5] + 1)
    assert torch.equal(copy.deepcopy(view), view)
