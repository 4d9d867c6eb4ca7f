"""compressed-tensors folders written by compressed-tensors itself, for ``load_pretrained``'s foreign path.

compressed-tensors' own API end to end: a preset scheme (``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``) or a
``QuantizationScheme`` (per-channel static), ``apply_quantization_config`` (with a ``kv_cache_scheme`` it hooks
every attention's KV cache), ``ModelCompressor.compress_model``, ``save_pretrained`` + ``update_config``. The one
step llm-compressor would do with its observers, the scales, is done here with compressed-tensors'
``calculate_qparams`` on min / max: per weight tensor / row / block / group, and per tensor for every static
input and the k / v states (read at compressed-tensors' own KV-cache hook, after RoPE) over calibration batches
run with quantization disabled.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def scheme_of(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if name == "FP8_CHANNEL_STATIC":  # per-channel weights, static per-tensor inputs
        return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float",
                                  strategy="channel", symmetric=True, dynamic=False),
                                  input_activations=QuantizationArgs(num_bits=8, type="float", strategy="tensor",
                                                                     symmetric=True, dynamic=False))
    return preset_name_to_scheme(name, ["Linear"])


def _weight_min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if args.strategy == "group":
        g = args.group_size
        parts = w.reshape(w.shape[0], w.shape[1] // g, g)
        return parts.amin(dim=2), parts.amax(dim=2)
    bn, bk = args.block_structure
    wp = maybe_pad_tensor_for_block_quant(w, (bn, bk))
    blocks = wp.reshape(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def ct_folder(model: nn.Module, folder: Path, scheme_name: str, ignore: list[str], calibration: list[dict],
              kv_cache: bool = False) -> None:
    """Quantize ``model`` (modified: pass a copy) with compressed-tensors and save it to ``folder``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = scheme_of(scheme_name)
    kv_args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                                        kv_cache_scheme=kv_args if kv_cache else None))
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    amax: dict[tuple[int, str], torch.Tensor] = {}

    def keep(key, t):
        a = t.detach().abs().amax().float()
        amax[key] = torch.maximum(amax.get(key, a), a)

    handles = []
    for m in quantized:
        m.quantization_enabled = False
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(lambda mod, args: keep((id(mod), "input"), args[0])))
        cache = getattr(m, "kv_cache", None)
        if cache is not None:
            def kv_hook(mod, args, kwargs, attn=m):
                keep((id(attn), "k"), args[0])
                keep((id(attn), "v"), args[1])
            handles.append(cache.register_forward_pre_hook(kv_hook, with_kwargs=True))
    with torch.no_grad():
        for batch in calibration:
            model(**batch)
    for h in handles:
        h.remove()
    with torch.no_grad():
        for m in quantized:
            m.quantization_enabled = True
            s = m.quantization_scheme
            if isinstance(m, nn.Linear):
                lo, hi = _weight_min_max(m.weight.detach().float(), s.weights)
                m.weight_scale.copy_(calculate_qparams(lo, hi, s.weights)[0].reshape(m.weight_scale.shape))
                if s.input_activations is not None and not s.input_activations.dynamic:
                    a = amax[(id(m), "input")].reshape(1)
                    m.input_scale.copy_(calculate_qparams(-a, a, s.input_activations)[0].reshape(m.input_scale.shape))
            for slot in ("k", "v"):
                if (id(m), slot) in amax:
                    a = amax[(id(m), slot)].reshape(1)
                    p = getattr(m, f"{slot}_scale")
                    p.copy_(calculate_qparams(-a, a, kv_args)[0].reshape(p.shape))
    compressor = ModelCompressor.from_pretrained_model(model)  # formats inferred per module (attention: dense)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
