"""Side-by-side timing: every variant runs in the same process, interleaved round by round, so load on
the machine hits all of them alike; each variant's time is the median of its rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dbr_quant.quantize.weights import fp8_weight_bytes, fp8_weight_of


@dataclass
class MiniLM:
    """all-MiniLM-L6-v2 (fp32) and its FP8 conversion, made the same way for every MiniLM benchmark."""

    model: nn.Module
    tokenizer: object
    calibration: list[dict]  # batches of 8 calibration sentences
    prepared: nn.Module
    converted: nn.Module


def minilm() -> MiniLM:
    import dbr_quant as dq
    from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, encode, load_minilm

    model, tok = load_minilm()
    calib = [encode(tok, CALIBRATION_SENTENCES[i:i + 8]) for i in range(0, len(CALIBRATION_SENTENCES), 8)]
    prepared = dq.prepare(model, example_kwargs=calib[0])
    dq.calibrate(prepared, calib, progress=False)
    return MiniLM(model, tok, calib, prepared, dq.convert(prepared))


def time_interleaved(variants: dict[str, Callable[[], object]], rounds: int = 15, warmup: int = 3,
                     inner: int = 1, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round (``inner`` calls per sample); ``clock``: wall time,
    or e.g. ``time.thread_time`` (CPU time of the calling thread: steadier on a loaded machine, one thread only)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        for _ in range(rounds):
            for name, fn in variants.items():
                t0 = clock()
                for _ in range(inner):
                    fn()
                samples[name].append((clock() - t0) / inner)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def paired_ratio(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of num/den measured in the same round: slow phases of a shared machine
    hit both sides of each pair alike, so the ratio is steadier than a ratio of medians."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every nn.Linear weight as stored: fp32/bf16 parameters, or FP8 data plus its scales."""
    total = fp8_weight_bytes(model)
    for m in model.modules():
        if isinstance(m, nn.Linear) and fp8_weight_of(m) is None:
            total += m.weight.numel() * m.weight.element_size()
    return total


def state_dict_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
