"""Session fixtures for the checkpoint tests: models converted once (ckpt_models builds them)."""

from __future__ import annotations

import warnings

import pytest
from ckpt_models import LM_HEAD_HP, Converted, convert_hf, llama
from threads import one_thread

import dbr_quant as dq


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def llama_converted() -> Converted:
    with one_thread():
        return convert_hf(llama(), LM_HEAD_HP)


@pytest.fixture(scope="session")
def minilm_converted() -> Converted:
    from dbr_quant.examples import minilm

    model, tokenizer = minilm.load_minilm()
    calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
    with warnings.catch_warnings(), one_thread():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs=calibration)
        dq.calibrate(prepared, [calibration], progress=False)
        converted = dq.convert(prepared)
    return Converted(model, converted, minilm.encode(tokenizer, minilm.EVAL_SENTENCES))


@pytest.fixture(scope="session")
def minilm_folder(minilm_converted, tmp_path_factory):
    folder = tmp_path_factory.mktemp("minilm")
    with one_thread():
        dq.save_pretrained(minilm_converted.converted, folder)
    return folder
