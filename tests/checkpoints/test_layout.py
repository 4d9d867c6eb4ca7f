"""The mapping's choices that the loader tests do not pin down: the dtype scales are written in, and the
file's exact contents for a bf16 Llama."""

from __future__ import annotations

import pytest
import torch
from ckpt_models import fp8_linears, input_scale
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import dbr_quant as dq
from dbr_quant.checkpoints.layout import scale_dtype
from dbr_quant.quantize.weights import fp8_weight_of


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False), st.sampled_from([torch.bfloat16, torch.float16]))
def test_scale_dtype_is_the_model_dtype_only_when_exact(value, dtype):
    s = torch.tensor([value], dtype=torch.float32)
    chosen = scale_dtype(s, dtype)
    exact = s.to(dtype).float().item() == s.item()  # fp16 overflow/underflow is inexact too
    assert chosen == (dtype if exact else torch.float32)
    assert s.to(chosen).float().item() == s.item()  # whatever is chosen holds the scale exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_exact_scales_use_the_model_dtype(dtype):
    assert scale_dtype(torch.tensor([0.5, 3.0, 2.0**-20]), dtype) == dtype
    assert scale_dtype(torch.tensor([1 / 3]), torch.float32) == torch.float32
    assert scale_dtype(torch.tensor([1 / 3]), torch.bfloat16) == torch.float32


def test_bf16_llama_file_contents(llama_converted, tmp_path):
    c = llama_converted.converted
    dq.save_pretrained(c, tmp_path)
    bf16_written = total = 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name, mod in fp8_linears(c).items():
            w = fp8_weight_of(mod)
            q, ws, xs = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale"), \
                f.get_tensor(f"{name}.input_scale")
            assert torch.equal(q.view(torch.uint8), w.qdata.view(torch.uint8))
            assert ws.shape == (w.qdata.shape[0], 1) and xs.shape == (1,)
            # calibrated fp32 scales are rarely bf16 numbers: float32 then, bf16 when exact; the values exactly
            for got, want in ((ws.flatten(), w.scale), (xs, input_scale(c, name).reshape(1))):
                exact = torch.equal(want.to(torch.bfloat16).float(), want)
                assert got.dtype == (torch.bfloat16 if exact else torch.float32) and torch.equal(got.float(), want)
                bf16_written += got.dtype == torch.bfloat16
                total += 1
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16 and "lm_head.weight_scale" not in keys
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert not any("_auto_quant_state" in k or "rotary" in k for k in keys)  # states and non-persistent buffers
    assert bf16_written < total / 4  # mostly float32 (here: the odd input scale happens to be a bf16 number)
