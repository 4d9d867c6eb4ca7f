"""Which reader understands a folder without ``dbr_quant.json``: the ``quant_method`` of ``config.json``'s
``quantization_config`` (or ModelOpt's ``hf_quant_config.json``) picks one; each turns the config into a
:class:`~dbr_quant.checkpoints.foreign_schemes.FolderScheme`. A new format is one module with ``QUANT_METHOD``
and ``read(quantization_config, where)``, and one entry in ``READERS``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbr_quant.checkpoints import compressed_tensors, fbgemm, hf_fp8, modelopt
from dbr_quant.checkpoints.errors import CheckpointError, read_json
from dbr_quant.checkpoints.foreign_schemes import FolderScheme

READERS: dict[str, Callable[[dict[str, Any], str], FolderScheme]] = {
    compressed_tensors.QUANT_METHOD: compressed_tensors.read,
    hf_fp8.QUANT_METHOD: hf_fp8.read,
    fbgemm.QUANT_METHOD: fbgemm.read,
    modelopt.QUANT_METHOD: modelopt.read,
}


def quantization_config_of(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = read_json(path)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) else None


def folder_scheme(folder: Path) -> FolderScheme | None:
    """The folder's FolderScheme; None when no config describes quantization (then it is no foreign folder)."""
    qc, where = quantization_config_of(folder), f"{folder / 'config.json'}: quantization_config"
    if qc is None:
        qc, where = modelopt.config_file(folder), str(folder / modelopt.HF_QUANT_CONFIG)
    if qc is None:
        return None
    method = str(qc.get("quant_method") or "")
    reader = READERS.get("modelopt" if method.lower().startswith("modelopt") else method)
    if reader is None:
        raise CheckpointError(f"{where}: quant_method {qc.get('quant_method')!r}; dbr_quant.load_pretrained reads "
                              f"folders of dbr_quant.save_pretrained and the FP8 formats {', '.join(sorted(READERS))}")
    return reader(qc, where)
