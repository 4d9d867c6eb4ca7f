"""Per-linear Hessian of the layer-wise output error, accumulated from calibration inputs.

For a linear y = x Wᵀ, replacing W by Q changes the squared output error summed over tokens by
tr((W-Q) H (W-Q)ᵀ) · n/2 with H = 2/n Σ_t x_tᵀ x_t — the quantity GPTQ minimises column by column.

Memory: ``folds · in_features² · 8`` bytes per accumulator (fp64 sums): 2 folds × 384² = 2.4 MB,
2 × 1536² = 38 MB, 2 × 4096² = 268 MB, 2 × 14336² = 3.3 GB. Linears that read the same input tensor
(q/k/v) can share one accumulator. Where all of a model's accumulators do not fit, accumulate for a
subset of linears per calibration pass (module by module: each pass runs the calibration batches again
and only the chosen linears add), round them, free their accumulators, and go on with the next subset.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HessianAccumulator:
    """Sums of xᵀx of one linear's calibration inputs, kept per cross-validation fold.

    Each ``add`` is one calibration batch and goes to fold ``batch_index % folds`` (round robin, so the
    assignment is deterministic and the folds get batches from all over the calibration set). Keeping
    the folds apart costs ``folds`` times the memory of one Hessian and lets ``choose_damping`` score a
    damping on batches the rounding did not see.

    Precision: each batch's xᵀx is one fp32 GEMM (BLAS speed, error ~ sqrt(tokens in the batch) ulp);
    the running sum over batches is fp64, so its error does not grow with the number of batches, and
    the Cholesky factorisations downstream (done in fp64) see an accurate matrix even at small damping.
    ``dtype=torch.float32`` halves the memory at the cost of that accumulation error.
    """

    def __init__(self, in_features: int, folds: int = 2, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> None:
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"HessianAccumulator: in_features must be an int >= 1, got {in_features!r}")
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 1:
            raise ValueError(f"HessianAccumulator: folds must be an int >= 1 (2 for 2-fold cross-validation), "
                             f"got {folds!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"HessianAccumulator: dtype must be torch.float32 or torch.float64, got {dtype}")
        self.in_features = in_features
        self.folds = folds
        # normal (not inference) tensors, so batches added in and out of inference mode can update them
        with torch.inference_mode(False):
            self.sums = torch.zeros(folds, in_features, in_features, dtype=dtype, device=device)
            self.tokens = torch.zeros(folds, dtype=torch.int64)
        self.batches = 0
        self.skipped_tokens = 0  # tokens with a NaN/inf feature: left out, as observers ignore non-finite values

    @staticmethod
    def bytes_needed(in_features: int, folds: int = 2, dtype: torch.dtype = torch.float64) -> int:
        """Memory the accumulator's sums take: folds · in_features² · element size."""
        return folds * in_features * in_features * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.sums.numel() * self.sums.element_size()

    @torch.no_grad()
    def add(self, x: Tensor, fold: int | None = None) -> None:
        """Fold one calibration batch of inputs (any shape ``[..., in_features]``) into the next fold, or into
        ``fold`` when given (calibrate: a linear called several times per forward adds each call to the fold
        of that forward; ``batches`` then counts calls)."""
        if fold is not None and (isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < self.folds):
            raise ValueError(f"HessianAccumulator.add: fold must be an int in [0, {self.folds}), got {fold!r}")
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0 \
                or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"HessianAccumulator.add: expected a floating-point tensor [..., {self.in_features}], "
                             f"got {shape}")
        rows = x.detach().reshape(-1, self.in_features).float()
        finite = torch.isfinite(rows).all(dim=1)
        if not bool(finite.all()):
            self.skipped_tokens += int((~finite).sum())
            rows = rows[finite]
        if fold is None:
            fold = self.batches % self.folds
        self.batches += 1
        if rows.shape[0] == 0:
            return
        rows = rows.to(self.sums.device)
        self.sums[fold] += (rows.T @ rows).to(self.sums.dtype)
        self.tokens[fold] += rows.shape[0]

    def nonempty_folds(self) -> list[int]:
        return [f for f in range(self.folds) if int(self.tokens[f]) > 0]

    def hessian(self, folds: list[int] | None = None) -> Tensor:
        """H = 2/n Σ xᵀx over the tokens of ``folds`` (default: all), fp64, ``[in_features, in_features]``."""
        chosen = list(range(self.folds)) if folds is None else list(folds)
        n = int(self.tokens[chosen].sum()) if chosen else 0
        if n == 0:
            raise ValueError(f"HessianAccumulator.hessian: no calibration tokens in folds {chosen}: run "
                             "calibration batches through the linear (add()) before rounding with GPTQ")
        return self.sums[chosen].sum(dim=0).double() * (2.0 / n)
