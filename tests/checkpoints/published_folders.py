"""FP8 folders in the published layouts of tools whose writers need a GPU or are not installed here, built
in plain torch (weights rounded to E4M3 with amax / 448 scales), and an independent plain-torch model of
what each computes.

* ``fp8`` (the Hub's ``quant_method: "fp8"``, per-tensor): vLLM's names (``model_executor/layers/quantization/
  fp8.py``: ``weight_scale``, static ``input_scale``) or transformers' (``integrations/finegrained_fp8.py``:
  0-d ``weight_scale_inv``, ``activation_scale``); ``weight_block_size: null``.
* ``fbgemm_fp8``: ``weight_scale`` float32 [out, 1], dynamic per-row inputs (transformers
  ``integrations/fbgemm_fp8.py``; vLLM ``fbgemm_fp8.py``), ``activation_scale_ub`` 1200.
* ModelOpt ``FP8`` / ``FP8_PER_CHANNEL_PER_TOKEN``: ``hf_quant_config.json`` (vLLM ``modelopt.py``), 0-d
  ``weight_scale`` and ``input_scale`` / ``weight_scale`` [out]; k/v scales as ``k_proj.k_scale`` /
  ``v_proj.v_scale`` (vLLM ``weight_utils.maybe_remap_kv_scale_name``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

E4M3_MAX = 448.0
FORMATS = ("fp8-static-vllm", "fp8-dynamic-transformers", "fbgemm", "modelopt", "modelopt-kv", "modelopt-pcpt")


def _layout(fmt: str) -> tuple[str, bool, bool]:
    """(weight granularity, static inputs, k/v scales)."""
    if fmt in ("fbgemm", "modelopt-pcpt"):
        return "channel", False, False
    return "tensor", fmt in ("fp8-static-vllm", "modelopt", "modelopt-kv"), fmt == "modelopt-kv"


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    s = (amax.float() / E4M3_MAX).clamp(min=1e-12)
    return (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def _amax(model: nn.Module, calibration: list[dict], skip: list[str]) -> tuple[dict, dict]:
    """Per linear input amax, per attention (k, v) amax of the projections' outputs (RoPE keeps a pair's norm;
    the scale gets 2x headroom)."""
    amax: dict[str, torch.Tensor] = {}
    handles = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and fqn not in skip:
            handles.append(mod.register_forward_hook(lambda m, i, o, fqn=fqn: amax.__setitem__(
                fqn, torch.maximum(amax.get(fqn, torch.zeros(())), i[0].detach().abs().amax()))))
            handles.append(mod.register_forward_hook(lambda m, i, o, fqn=fqn: amax.__setitem__(
                fqn + ":out", torch.maximum(amax.get(fqn + ":out", torch.zeros(())), o.detach().abs().amax()))))
    with torch.no_grad():
        for batch in calibration:
            model(**batch)
    for h in handles:
        h.remove()
    return ({k: v for k, v in amax.items() if not k.endswith(":out")},
            {k.removesuffix(":out"): v for k, v in amax.items() if k.endswith(":out")})


def published_folder(model: nn.Module, folder: Path, fmt: str, calibration: list[dict],
                     skip: tuple[str, ...] = ("lm_head",)) -> None:
    granularity, static, kv = _layout(fmt)
    inputs, outputs = _amax(model, calibration, list(skip))
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for fqn, mod in model.named_modules():
        for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if pname in mod._non_persistent_buffers_set or id(t) in seen:
                continue
            seen.add(id(t))
            name = f"{fqn}.{pname}" if fqn else pname
            if isinstance(mod, nn.Linear) and pname == "weight" and fqn not in skip:
                q, s = _quantize(t.detach(), granularity == "channel")
                state[name] = q
                if fmt == "fp8-dynamic-transformers":
                    state[f"{fqn}.weight_scale_inv"] = s.reshape(())
                else:
                    state[f"{fqn}.weight_scale"] = s.reshape(-1) if fmt == "modelopt-pcpt" else s.reshape(
                        -1, 1) if granularity == "channel" else s.reshape(())
                if static:
                    state[f"{fqn}.input_scale"] = (inputs[fqn] / E4M3_MAX).reshape(()).float()
            else:
                state[name] = t.detach().contiguous()
    if kv:
        for fqn, mod in model.named_modules():
            if hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):
                for p in ("k", "v"):
                    state[f"{fqn}.{p}_proj.{p}_scale"] = (2 * outputs[f"{fqn}.{p}_proj"] / E4M3_MAX).reshape(()).float()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    if fmt.startswith("fp8"):
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                                      "weight_block_size": None, "modules_to_not_convert": list(skip)}
    elif fmt == "fbgemm":
        cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                      "modules_to_not_convert": list(skip)}
    else:
        algo = "FP8_PER_CHANNEL_PER_TOKEN" if fmt == "modelopt-pcpt" else "FP8"
        (folder / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv else None,
                             "exclude_modules": list(skip)}}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def reference(model: nn.Module, folder: Path) -> nn.Module:
    """``model`` whose FP8 linears compute ``F.linear(fake_quant(x), q · s, b)`` from the folder's tensors: static
    per-tensor with the input scale, else dynamic per token (amax / 448)."""
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    ref = copy.deepcopy(model)
    for name, t in stored.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        fqn = name.removesuffix(".weight")
        s = stored.get(f"{fqn}.weight_scale", stored.get(f"{fqn}.weight_scale_inv"))
        w = t.float() * s.float().reshape(-1, 1) if s.numel() > 1 else t.float() * s.float()
        s_in = stored.get(f"{fqn}.input_scale")
        mod = ref.get_submodule(fqn)

        def forward(x, mod=mod, w=w, s_in=s_in):
            xf = x.float()
            s = s_in.float() if s_in is not None else (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
            xq = (xf * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
            return F.linear(xq, w, None if mod.bias is None else mod.bias.float()).to(x.dtype)

        mod.forward = forward
    return ref
