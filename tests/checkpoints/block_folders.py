"""Block-scaled FP8 folders written by other tools, for ``load_pretrained``'s foreign-folder path, and an
independent plain-torch model of what such a folder computes.

* ``ct_fp8_block_folder``: compressed-tensors' own API end to end — the ``FP8_BLOCK`` preset scheme,
  ``apply_quantization_config``, ``ModelCompressor.compress_model`` (its FloatQuantizationCompressor pads
  ragged weights to whole blocks, quantizes, truncates), ``save_pretrained`` + ``update_config``. The one
  step llm-compressor would do with its observer, the per-block weight scale, uses compressed-tensors'
  ``calculate_qparams`` on each block's min / max (padded blocks as compressed-tensors pads them).
* ``fine_grained_fp8_folder``: transformers' FineGrainedFP8 quantizer refuses to quantize without a GPU
  (``validate_environment``: "No GPU or XPU found"); its quantization op ``Fp8Quantize`` is plain torch, so
  this runs that op on each linear weight on CPU, writes the state dict with ``safetensors`` and a
  ``FineGrainedFP8Config(weight_block_size=...)`` into config.json. ``Fp8Quantize`` passes ragged weights
  through unquantized; for those (``ragged=True``) the weight is quantized here in plain torch on the
  DeepSeek-V3 grid (zero-padded blocks, amax / 448, scale_inv = amax / 448).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0


def ct_fp8_block_folder(model: nn.Module, folder: Path, ignore: list[str]) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    bn, bk = scheme.weights.block_structure
    with torch.no_grad():
        for mod in model.modules():
            if getattr(mod, "quantization_scheme", None) is None:
                continue
            w = maybe_pad_tensor_for_block_quant(mod.weight.detach(), (bn, bk))
            blocks = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)
            mod.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def _pad_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    n, k = w.shape
    wp = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = wp.reshape(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(wp.shape)[:n, :k].contiguous(), scale_inv


def fine_grained_fp8_folder(model: nn.Module, folder: Path, skip: list[str], block=(128, 128),
                            ragged: bool = False) -> None:
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=skip)

    class _Quantizer:  # what Fp8Quantize reads of its HfQuantizer
        quantization_config = config

    op = Fp8Quantize(_Quantizer())
    state = {}
    for fqn, mod in model.named_modules():
        for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if pname in mod._non_persistent_buffers_set:
                continue
            name = f"{fqn}.{pname}" if fqn else pname
            if any(t is v for v in state.values()):
                continue  # tied
            if isinstance(mod, nn.Linear) and pname == "weight" and fqn not in skip:
                out = op.convert({name: t.detach()})
                if out[name].dtype != torch.float8_e4m3fn:  # Fp8Quantize passes ragged weights through
                    assert ragged, f"{name} {tuple(t.shape)} is ragged: pass ragged=True"
                    q, s = _pad_quantize(t.detach(), block)
                    out = {name: q, f"{fqn}.weight_scale_inv": s}
                state.update({k: v.contiguous() for k, v in out.items()})
            else:
                state[name] = t.detach().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = config.to_dict()
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


# ------------------------------------------------------------------ the independent reference
def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q[n, k] · scale[n // bn, k // bk]`` by explicit index arithmetic (no padding, no repeat)."""
    n, k = q.shape
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    assert scale.shape == (math.ceil(n / block[0]), math.ceil(k / block[1]))
    return q.float() * scale.float()[rows][:, cols]


def group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic per-token-group FP8 (E4M3) of x, dequantized: scale = group amax / 448 (1 for an all-zero group)."""
    k = x.shape[-1]
    xf = x.float()
    out = torch.empty_like(xf)
    for start in range(0, k, group):
        part = xf[..., start:start + group]
        amax = part.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        out[..., start:start + group] = (part * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return out.to(x.dtype)


def static_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 (E4M3) of x with ``scale``, dequantized."""
    s = scale.float().reshape(())
    return ((x.float() * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def plain_torch_reference(model: nn.Module, weights: dict[str, torch.Tensor], group: int,
                          input_scales: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """``model`` (high precision) whose listed linears compute ``F.linear(fake_quant(x), W, b)`` with the given
    dequantized weights — dynamic per-token-group ``fake_quant``, or static per-tensor with ``input_scales`` —:
    the checkpoint's model in plain torch."""
    import copy

    ref = copy.deepcopy(model)
    for fqn, w in weights.items():
        mod = ref.get_submodule(fqn)

        def forward(x, mod=mod, w=w, s=None if input_scales is None else input_scales[fqn]):
            xq = group_fake_quant(x, group) if s is None else static_fake_quant(x, s)
            y = F.linear(xq.float(), w, None if mod.bias is None else mod.bias.float())
            return y.to(x.dtype)

        mod.forward = forward
    return ref
