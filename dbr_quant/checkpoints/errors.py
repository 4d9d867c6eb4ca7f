"""The one error type of checkpoint saving and loading, and the folder's JSON files read with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint cannot be written in the requested format, or a folder does not hold what loading needs
    (a tensor missing, of the wrong shape or dtype, a non-finite scale, a truncated file). The message names
    the tensor or module and what to do."""


def read_json(path: Path) -> Any:
    """The JSON value of a folder's file (``config.json``, ``hf_quant_config.json``, ``dbr_quant.json``); a file
    that cannot be read or parsed is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from e
