"""The safetensors file format, written one tensor at a time and read with every offset checked.

Why not ``safetensors.torch.save_file``: it takes the whole shard as a dict and serializes it into one
bytes object before writing, so the peak extra memory is a shard (or two). Here the header is built from
shapes and dtypes alone, then each tensor is produced, written straight from its storage (no copy for a
contiguous CPU tensor) and dropped: the peak extra memory is the largest tensor that needs a conversion
(a scale cast, a dequantized HF ``Conv1D`` weight). The format (8-byte little-endian header length, a
JSON header padded with spaces to 8 bytes, then the tensors back to back in header order) is checked by
the tests against the ``safetensors`` package and transformers.

Reading parses the header itself so that a truncated or inconsistent file is an error that names the
tensor (``safetensors`` would only name the file). Nothing is unpickled: data is raw bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dbr_quant.checkpoints.errors import CheckpointError

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
NAMES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the safetensors package's own limit
OWN_MAPPING = 2**20  # bytes from which a tensor read gets its own memory mapping (_fresh_bytes)


@dataclass
class Entry:
    """A tensor to write: its name, dtype and shape up front, the values produced only when written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def tensor_entry(name: str, t: torch.Tensor, dtype: torch.dtype | None = None,
                 shape: tuple[int, ...] | None = None) -> Entry:
    """An entry that writes ``t`` (detached), reshaped to ``shape`` and cast to ``dtype`` when given."""
    out_dtype = t.dtype if dtype is None else dtype
    out_shape = tuple(t.shape) if shape is None else shape
    return Entry(name, out_dtype, out_shape, lambda: t.detach().reshape(out_shape).to(out_dtype))


def parse_size(size: int | str) -> int:
    """``max_shard_size``: bytes, or a string such as "5GB" (10⁹) / "5GiB" (2³⁰) / "500MB" / "100kB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)\s*", str(size), re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size {size!r}: give bytes (int) or a string like '5GB', '500MB', '2GiB'")
    unit = m.group(2).lower()
    power = "bkmgt".index(unit[0]) if unit != "b" else 0
    base = 1024 if "i" in unit else 1000
    value = int(float(m.group(1)) * base**power)
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def order_for_alignment(entries: Iterable[Entry]) -> list[Entry]:
    """Widest dtypes first (stable): each tensor then starts at a multiple of its element size, as the
    ``safetensors`` package lays files out (readers may view the bytes in place)."""
    return sorted(entries, key=lambda e: -e.dtype.itemsize)


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_file(path: str | os.PathLike, entries: list[Entry], metadata: dict[str, str]) -> int:
    """Write one safetensors file, producing and writing one tensor at a time; returns its size."""
    header = _header(entries, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for e in entries:
            t = e.produce()
            if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise CheckpointError(f"{e.name}: produced {t.dtype} {list(t.shape)}, planned {e.dtype} "
                                      f"{list(e.shape)} (a dbr_quant bug)")
            t = t.detach().reshape(-1)
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            if t.numel():
                f.write(t.view(torch.uint8).numpy().data)
            del t
        size = f.tell()
    expected = 8 + len(header) + sum(e.nbytes for e in entries)
    if size != expected:
        raise CheckpointError(f"{path}: wrote {size} bytes, expected {expected}")
    return size


# ---------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a file (from the header, checked against the file's size)."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse and check a safetensors header: every tensor's dtype, shape and byte range. A tensor whose
    bytes lie past the end of the file (a truncated download or copy) is an error naming it."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: the header claims {n} bytes but the file has {size} (truncated "
                                      "or not a safetensors file)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data_start = 8 + n
    tensors: dict[str, StoredTensor] = {}
    for name, info in header.items():
        try:
            dtype = NAMES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{name} in {path}: malformed header entry {info!r}") from e
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or begin < 0 or end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{name} in {path}: {info['dtype']} {list(shape)} does not fit its byte range "
                                  f"[{begin}, {end})")
        if data_start + end > size:
            raise CheckpointError(f"{name} in {path}: its bytes end at {data_start + end} but the file has {size} "
                                  "bytes (truncated file)")
        tensors[name] = StoredTensor(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors, metadata


def _fresh_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of new memory. A large tensor gets an anonymous mapping of its own (``mmap.mmap(-1, n)``,
    unmapped when the tensor is dropped), not the C heap: the heap keeps freed blocks resident, and a load frees
    many (convert's [gate; up] stacking replaces the two weights read): 35 MB of a 193 MB folder's peak
    (benchmarks/checkpoint_memory.py --foreign)."""
    if nbytes < OWN_MAPPING:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def read_tensor(t: StoredTensor) -> torch.Tensor:
    """The tensor's values, read into fresh memory (no mapping of the file stays alive)."""
    buf = _fresh_bytes(t.nbytes)
    with open(t.path, "rb") as f:
        f.seek(t.begin)
        got = f.readinto(buf.numpy().data) if t.nbytes else 0
    if got != t.nbytes:
        raise CheckpointError(f"{t.name} in {t.path}: read {got} of {t.nbytes} bytes (file changed or truncated)")
    return buf.view(t.dtype).reshape(t.shape)
