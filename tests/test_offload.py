"""Models dispatched by accelerate (weights on ``meta``, kept in CPU memory or on disk by accelerate's hooks):
prepare → calibrate → convert must give the same report (fusions included) and the same outputs, bit for bit,
as the same model converted in memory, and each weight must end up in FP8 where accelerate keeps it."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import ModelHook, add_hook_to_module  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.integrations.accelerate import FP8WeightsMap  # noqa: E402
from dbr_quant.quantize.weights import FP8Weight  # noqa: E402
from dbr_quant.runtime.interception import has_hooks  # noqa: E402

hf_logging.set_verbosity_error()

EXAMPLE = {"input_ids": torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))}
CALIBRATION = [{"input_ids": torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(s))}
               for s in range(3)]
PROBE = {"input_ids": torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(9))}
MLP = "model.layers.1.mlp.gate_proj"


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, initializer_range=0.05, pad_token_id=0,
        use_cache=False)).eval()


def _quantize(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lm_head etc. stay high precision: not what this file tests
        prepared = dq.prepare(model, example_kwargs=EXAMPLE, inplace=True)
        dq.calibrate(prepared, CALIBRATION, progress=False)
        return dq.convert(prepared, inplace=True)


def _rows(model: nn.Module) -> list[tuple]:
    return [(r["fqn"], r["fp8"], r["fusion"]) for r in dq.report(model)]


@pytest.fixture(scope="module")
def in_memory() -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
    converted = _quantize(_llama())
    with dq.disabled():
        hp = converted(**PROBE).logits
    return _rows(converted), converted(**PROBE).logits, hp


def _dispatch(kind: str, tmp) -> nn.Module:
    model = _llama()
    if kind == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device="cpu")
    if kind == "disk_offload":
        return accelerate.disk_offload(model, str(tmp), execution_device="cpu")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "some parameters are on the meta device"
        return accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp))


@pytest.mark.parametrize("kind", ["cpu_offload", "disk_offload", "dispatch_model"])
def test_offloaded_model_converts_like_the_in_memory_one(kind, tmp_path, in_memory):
    rows, logits, hp_logits = in_memory
    model = _dispatch(kind, tmp_path)
    assert model.get_submodule(MLP).weight.device.type == "meta"
    converted = _quantize(model)  # prepare used to fail: "Tensor on device meta is not on the expected device cpu"
    assert _rows(converted) == rows
    assert any(fusion == "norm_gated_mlp" for _, _, fusion in rows)  # accelerate's hooks did not block fusions
    assert torch.equal(converted(**PROBE).logits, logits)
    with dq.disabled():
        assert torch.equal(converted(**PROBE).logits, hp_logits)

    module = converted.get_submodule(MLP)
    w = module._parameters["weight"]
    assert type(w) is FP8Weight and w.device.type == "meta" and w.dtype == torch.float32  # offloaded again
    loaded = module._hf_hook.weights_map["weight"]
    assert isinstance(module._hf_hook.weights_map, FP8WeightsMap)
    assert type(loaded) is FP8Weight and loaded.qdata.dtype == torch.float8_e4m3fn and loaded.shape == w.shape
    if kind == "cpu_offload":  # the CPU state dict now holds FP8 bytes, not the fp32 weight
        store = module._hf_hook.weights_map.inner.dataset
        assert f"{MLP}.weight" not in store and store[f"{MLP}.weight.fp8"].dtype == torch.float8_e4m3fn
    else:  # FP8 .dat files next to accelerate's (left as they were)
        fp8_dirs = [d for d in os.listdir(tmp_path) if d.startswith("dbr_fp8_")]
        assert len(fp8_dirs) == 1
        data = tmp_path / fp8_dirs[0] / f"{MLP}.weight.dat"
        assert data.stat().st_size == w.numel()  # one byte per weight
        assert (tmp_path / f"{MLP}.weight.dat").stat().st_size == 4 * w.numel()


def test_prepare_copies_an_offloaded_model(in_memory):
    """inplace=False: the copy has its own weights map; the original keeps its fp32 weights."""
    rows, logits, _ = in_memory
    model = accelerate.cpu_offload(_llama(), execution_device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs=EXAMPLE)
        dq.calibrate(prepared, CALIBRATION, progress=False)
        converted = dq.convert(prepared)
    assert torch.equal(converted(**PROBE).logits, logits)
    original = model.get_submodule(MLP)._hf_hook.weights_map["weight"]
    assert type(original) is torch.Tensor and original.dtype == torch.float32
    assert torch.equal(model(**PROBE).logits, _llama()(**PROBE).logits)


class _Negating(ModelHook):
    """Not a device hook: it changes the module's input, so it must see the real call. (It keeps |x|: the
    observer, like for torch's forward pre-hooks, sees the input before the hook.)"""

    def pre_forward(self, module, *args, **kwargs):
        return tuple(-a for a in args), kwargs


def test_only_device_hooks_are_transparent():
    lin = nn.Linear(4, 4)
    add_hook_to_module(lin, accelerate.hooks.AlignDevicesHook(execution_device="cpu"))
    assert not has_hooks(lin)
    add_hook_to_module(lin, _Negating(), append=True)
    assert has_hooks(lin)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    block = Block().eval()
    ref = copy.deepcopy(block)
    add_hook_to_module(block.fc2, _Negating())
    x = torch.randn(3, 8)
    plain = dq.convert(dq.calibrate(dq.prepare(copy.deepcopy(ref), x), [x], progress=False))
    assert {r["fqn"]: r["fusion"] for r in dq.report(plain)} == {"fc1": "mlp", "fc2": "mlp"}
    converted = dq.convert(dq.calibrate(dq.prepare(block, x), [x], progress=False))
    # the hook sees fc2's real input: fc2 is not fused into fc1's MLP
    assert {r["fqn"]: r["fusion"] for r in dq.report(converted)} == {"fc1": "linear_act", "fc2": None}
    w1, w2 = converted.fc1.weight.dequantize(), converted.fc2.weight.dequantize()
    with dq.disabled():  # high precision with the FP8 weights dequantized, the hook's negation included
        hp = F.linear(-torch.relu(F.linear(x, w1, ref.fc1.bias)), w2, ref.fc2.bias)
        torch.testing.assert_close(converted(x), hp)
    expected, unhooked = ref.fc2(-torch.relu(ref.fc1(x))), ref(x)
    assert (converted(x) - expected).norm() < 0.1 * (unhooked - expected).norm()


def test_device_moves_that_move_nothing_do_not_split_fusions():
    """``x.to(x.device)`` (what accelerate's hooks do at module boundaries) is not an op: fc1 → move → relu
    → fc2 stays one fused MLP, with the same output as without the move."""

    class Moving(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            h = self.fc1(x).to("cpu", non_blocking=True)
            return self.fc2(torch.relu(h).to(device=x.device))

    torch.manual_seed(0)
    model = Moving().eval()
    x = torch.randn(3, 8)
    converted = dq.convert(dq.calibrate(dq.prepare(model, x), [x], progress=False))
    assert {r["fqn"]: r["fusion"] for r in dq.report(converted)} == {"fc1": "mlp", "fc2": "mlp"}
    plain = nn.Sequential(model.fc1, nn.ReLU(), model.fc2)
    expected = dq.convert(dq.calibrate(dq.prepare(plain, x), [x], progress=False))
    assert torch.equal(converted(x), expected(x))
