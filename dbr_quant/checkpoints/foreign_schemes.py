"""What a folder written by another tool says about its FP8 tensors, as typed data: one
:class:`FolderScheme` per folder, built by the format's reader (``compressed_tensors.py``, ``hf_fp8.py``,
``fbgemm.py``, ``modelopt.py``; ``readers.py`` picks one from the folder's config), read by ``foreign.py``.

A reader only translates the format's words into these types; everything that checks tensors and builds
the converted model is written once, in ``foreign.py``. A scheme this release cannot run exactly (weight-only
FP8, E5M2, zero points, ...) is described as it is and refused by :meth:`LinearScheme.override`, naming the
setting, so that a format or scheme added later (MXFP8, weight-only execution) is a new value here plus a
reader, not a new loader.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.qconfig import Override, TensorQConfig

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WeightGranularity = Literal["tensor", "channel", "block"]
ActivationGranularity = Literal["tensor", "token", "group"]


@dataclass(frozen=True)
class WeightScheme:
    """FP8 (E4M3) weights of one linear: ``W = weight · scale`` with one scale per tensor, per output row, or per
    ``block`` = (rows, columns) tile (a compressed-tensors ``group`` weight of group g is the block (1, g)).
    ``scale_names``: what the file may call the scale tensor, tried in order (``weight_scale``,
    ``weight_scale_inv``: a dequantization scale in every format despite the name)."""

    granularity: WeightGranularity
    scale_names: tuple[str, ...] = ("weight_scale",)
    block: tuple[int, int] | None = None

    def scale_shapes(self, out_features: int, in_features: int) -> tuple[tuple[int, ...], ...]:
        """The scale shapes the formats write for a [out, in] weight; the first is named in messages."""
        if self.granularity == "tensor":
            return (), (1,)
        if self.granularity == "channel":
            return (out_features, 1), (out_features,)
        assert self.block is not None
        grid = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        return (grid,)

    def as_fp8_weight_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """The file's scale in ``FP8Weight``'s layout (0-d, [out] or the block grid), float32."""
        s = scale.float()
        return s.reshape(()) if self.granularity == "tensor" else s.reshape(-1) if self.granularity == "channel" else s

    def qconfig(self) -> TensorQConfig:
        return TensorQConfig(granularity=self.granularity, block=self.block or (128, 128))


@dataclass(frozen=True)
class ActivationScheme:
    """FP8 (E4M3) inputs of one linear: static per tensor (a scale tensor named one of ``scale_names``) or
    dynamic per tensor / token / ``group_size`` channels of a token."""

    granularity: ActivationGranularity
    dynamic: bool
    group_size: int | None = None
    scale_names: tuple[str, ...] = ("input_scale",)


@dataclass(frozen=True)
class LinearScheme:
    """An FP8 linear as a file describes it. ``activation`` None: weight-only FP8 (high-precision inputs).
    ``refused``: a setting the file holds that dbr_quant cannot run exactly (said when the folder is read)."""

    weight: WeightScheme
    activation: ActivationScheme | None
    refused: str | None = None

    def override(self, fqn: str, where: str, static: bool = False) -> Override:
        """The per-module setting that makes dbr_quant run ``fqn`` as the file says (``static``: with static
        per-tensor input scales still to be calibrated instead), or a CheckpointError."""
        if self.refused is not None:
            raise CheckpointError(f"'{fqn}' ({where}): {self.refused}")
        a = self.activation
        w = self.weight
        if a is None:  # weight-only (vLLM's CompressedTensorsW8A16Fp8): QConfig(weight_only=True), see FolderPlan
            if static:
                raise CheckpointError(f"'{fqn}' ({where}): weight-only FP8 (no input_activations) has no input scale "
                                      "to calibrate; load it without recalibrate=True")
            if w.granularity not in ("tensor", "channel"):
                raise CheckpointError(f"'{fqn}' ({where}): weight-only FP8 with {w.granularity} weights; dbr_quant's "
                                      "weight-only GEMM takes per-tensor or per-channel weight scales (as vLLM's "
                                      "CompressedTensorsW8A16Fp8 does)")
            return Override(pattern=f"^{re.escape(fqn)}$", weight=w.qconfig())
        if a.granularity == "group" and (w.granularity != "block" or w.block is None or a.group_size != w.block[1]):
            raise CheckpointError(
                f"'{fqn}' ({where}): dynamic per-token-group activations (group {a.group_size}) with {w.granularity} "
                f"weights{'' if w.block is None else f' of block {list(w.block)}'}; dbr_quant's GEMMs apply group "
                "scales only with block weights whose column count equals the group")
        activation = TensorQConfig(granularity="tensor" if static else a.granularity, group_size=a.group_size or 128)
        return Override(pattern=f"^{re.escape(fqn)}$", weight=w.qconfig(), activation=activation,
                        dynamic=False if static else a.dynamic)


@dataclass(frozen=True)
class Target:
    """Which modules a config entry means: an exact module ``name``, a ``regex`` (re.match, compressed-tensors'
    ``re:`` prefix), a shell ``glob`` (ModelOpt's exclude_modules) or a ``class`` name anywhere in the MRO
    (compressed-tensors' ``Linear``)."""

    kind: Literal["name", "regex", "glob", "class"]
    pattern: str

    def matches(self, fqn: str, module: nn.Module) -> bool:
        if self.kind == "name":
            return fqn == self.pattern
        if self.kind == "regex":
            return re.match(self.pattern, fqn) is not None
        if self.kind == "glob":
            return fnmatch.fnmatchcase(fqn, self.pattern)
        return any(c.__name__ == self.pattern for c in type(module).__mro__)


_PRIORITY = {"name": 0, "regex": 1, "glob": 1, "class": 2}  # compressed-tensors: exact name > regex > class


@dataclass(frozen=True)
class KVCacheScheme:
    """Static per-tensor FP8 k / v scales of attention modules. ``names``: the (k, v) scale tensors relative to
    the attention module (compressed-tensors ``k_scale``; ModelOpt ``k_proj.k_scale``)."""

    names: tuple[str, str] = ("k_scale", "v_scale")


@dataclass(frozen=True)
class FolderScheme:
    """Everything a foreign folder's config says: which linears are FP8 with which scheme (``rules``, the
    first best-priority match wins), which are kept high precision (``ignore``), the KV-cache scales."""

    tool: str  # for messages, e.g. "compressed-tensors"
    where: str  # the config file, for messages
    rules: tuple[tuple[Target, LinearScheme], ...]
    ignore: tuple[Target, ...] = ()
    kv_cache: KVCacheScheme | None = None

    def ignored(self, fqn: str, module: nn.Module) -> bool:
        return any(t.matches(fqn, module) for t in self.ignore)

    def scheme_of(self, fqn: str, module: nn.Module) -> LinearScheme | None:
        found = [(_PRIORITY[t.kind], i, s) for i, (t, s) in enumerate(self.rules) if t.matches(fqn, module)]
        return min(found, key=lambda f: (f[0], f[1]))[2] if found else None
