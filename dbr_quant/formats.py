"""FP8 formats: the one place that knows each format's dtype and largest finite value."""

from __future__ import annotations

import enum

import torch


class FP8Format(enum.Enum):
    """An FP8 storage format. ``max`` is the largest finite magnitude (values saturate to it)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        return 448.0 if self is FP8Format.E4M3 else 57344.0

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FP8Format.E4M3 else 2

    @property
    def exponent_bias(self) -> int:
        return 7 if self is FP8Format.E4M3 else 15

    @classmethod
    def of(cls, dtype: torch.dtype) -> FP8Format:
        """The format whose storage dtype is ``dtype``."""
        for fmt in cls:
            if fmt.dtype == dtype:
                return fmt
        raise ValueError(f"{dtype} is not an FP8 dtype: use one of {[f.dtype for f in cls]}")

    @classmethod
    def parse(cls, value: FP8Format | str) -> FP8Format:
        """Accept the enum or its name/value in any case ("E4M3", "e5m2")."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown FP8 format {value!r}: use one of {[f.value for f in cls]}") from None


def safe_scale(amax: torch.Tensor, fmt: FP8Format, margin: int = 0) -> torch.Tensor:
    """Dequantization scale for an amax: x ≈ fp8 · scale with |x| = amax landing on fmt.max.

    All-zero (amax == 0) and non-finite amax give scale 1; the result is never 0, inf or NaN.
    ``margin`` leaves 2**margin headroom (Transformer Engine's delayed-scaling margin).
    """
    amax = amax.float()
    # divided by a tensor on amax's device: CUDA torch turns a division by a Python number into a multiply
    # by its reciprocal (BinaryDivTrueKernel.cu), 1 ulp off IEEE amax / max now and then, which would make
    # a scale computed on the GPU differ from the CPU's and from the Triton kernels' div_rn
    scale = amax * (2.0**margin) / torch.tensor(fmt.max, dtype=torch.float32, device=amax.device)
    ok = torch.isfinite(scale) & (scale > 0) & torch.isfinite(amax)
    scale = torch.where(ok, scale, torch.ones_like(scale))
    # a tiny but non-zero amax must not produce a subnormal/zero scale whose inverse overflows
    return scale.clamp(min=torch.finfo(torch.float32).tiny)
