"""Fixtures the outside suites share."""

from __future__ import annotations

import warnings

import pytest

import dbr_quant as dq


@pytest.fixture(scope="module")
def minilm():
    """The real all-MiniLM-L6-v2 and its FP8 conversion (calibrated on the example sentences): (fp32 model,
    converted, eight held-out sentences encoded)."""
    from dbr_quant.examples import minilm as example

    model, tokenizer = example.load_minilm()
    calibration = example.encode(tokenizer, example.CALIBRATION_SENTENCES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs=calibration)
        dq.calibrate(prepared, [calibration], progress=False)
        converted = dq.convert(prepared)
    return model, converted, example.encode(tokenizer, example.EVAL_SENTENCES[:8])
