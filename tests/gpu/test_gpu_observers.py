"""Observers on a real GPU pick the same amax (bits) as on the CPU from the same data (skipped without CUDA).

CUDA torch divides by a Python number as a multiply by its reciprocal, about 1 ulp off IEEE division now and
then; the MSE observer's candidate search and ``formats.safe_scale`` divide by device tensors so that a model
calibrated on a GPU gets the CPU's scales. Running max (no arithmetic) is the control. The percentile observer is
not held to bits: torch.nanquantile's interpolation may round differently on CUDA (fused multiply-add).
"""

from __future__ import annotations

import pytest
import torch

from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.observers import MSEObserver, RunningMaxObserver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fmt", list(FP8Format))
@pytest.mark.parametrize("make", [lambda f: MSEObserver(f, axis=0), lambda f: MSEObserver(f),
                                  lambda f: RunningMaxObserver(f, axis=0)])
def test_observer_on_cuda_gives_the_cpus_amax_and_scale(make, fmt):
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(64, 300, generator=gen) * torch.rand(64, 1, generator=gen) * 5 for _ in range(3)]
    on_cpu, on_gpu = make(fmt), make(fmt).cuda()
    for x in batches:
        on_cpu(x)
        on_gpu(x.cuda())
    assert torch.equal(on_gpu.amax.cpu(), on_cpu.amax)
    assert torch.equal(safe_scale(on_gpu.amax, fmt).cpu(), safe_scale(on_cpu.amax, fmt))
