"""The architecture of a Hugging Face folder, built from its ``config.json`` without weights, for
``load_pretrained(folder)`` with no model: parameters on the meta device (accelerate's
``init_empty_weights(include_buffers=False)``: buffers such as rotary tables are computed as usual, since no
checkpoint holds them), in the dtype the config names. The loader then places every tensor as read from the
folder, so no high-precision weight is ever materialized."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dbr_quant.checkpoints.errors import CheckpointError


def architecture_of(folder: Path) -> nn.Module:
    """The model class ``config.json``'s ``architectures`` names, built from the config with meta parameters."""
    try:
        import transformers
        from accelerate import init_empty_weights
    except ImportError as e:  # optional dependencies: a model passed in needs neither
        raise CheckpointError(f"load_pretrained({str(folder)!r}) without a model builds the architecture from "
                              f"config.json with transformers and accelerate ({e}); install them or pass the model"
                              ) from e
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json to build the architecture from; pass the model")
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):  # the loader reads it; the architecture is the plain one
        del config.quantization_config
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise CheckpointError(f"{folder / 'config.json'}: architectures {names!r} names no transformers model class; "
                              "pass the model")
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype)
    return model.eval()
