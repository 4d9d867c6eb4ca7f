"""``load_pretrained`` for FP8 folders written by other tools (no ``dbr_quant.json``): compressed-tensors,
the Hub's ``fp8``, FBGEMM, ModelOpt. A reader (``readers.py``) turns the folder's config into a
:class:`FolderScheme`; this module checks the folder's tensors against it and the architecture, then builds the
converted model, the same way for every format.

1. Every FP8 ``weight`` (E4M3 in the file) belongs to an ``nn.Linear`` of the model that the config quantizes
   (a config group targets it, ``ignore`` does not); its scheme must be one dbr_quant runs exactly
   (:meth:`LinearScheme.override`); its weight scale has one of the shapes the format writes (a block scale's
   block comes from the config, never from the grid: a 300×200 weight with 128×128 blocks has a 3×2 grid,
   which transformers' grid-inferring ``Fp8Dequantize`` reads as 100×100 blocks); a static input scale is one
   number. With a KV-cache scheme, every attention module with a k scale has a v scale. Everything else the
   model holds is in the file with its shape; nothing else is.
2. Every scale is finite and positive, no FP8 weight holds a NaN byte.
3. Only then (``assemble.py``): a skeleton of the model gets the FP8 weights as read and everything else; the
   trace runs the listed linears in FP8 with their schemes (one ``Override`` each) and nothing else (a catch-all
   skip); static scales come from the file (no calibration).

MoE experts stored per expert under vLLM's names (``experts.<e>.w1/w3/w2`` or ``gate_proj/up_proj/down_proj``)
go into a model whose experts are one module with 3-D weights: ``foreign_experts.py`` finds, checks and stacks
them, and the trace runs them with dbr_quant's FP8 MoE block.

FP8 attention: a folder with k/v scales runs ``scaled_dot_product_attention`` of those modules with dbr_quant's
FP8 attention kernel: k and v with the file's static scales, q with the scale 1.0 that vLLM uses when a
checkpoint has no q scale (``model_executor/layers/quantization/kv_cache.py`` BaseKVCacheMethod), the
probabilities with the kernel's fixed 1/448. transformers (compressed-tensors' ``modeling/kvcache.py``) only
rounds k and v and computes attention in high precision; tests/checkpoints measure the difference.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dbr_quant.checkpoints import assemble, foreign_experts
from dbr_quant.checkpoints.assemble import Skeleton, example_args, finish_convert, on_model_device, trace
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.foreign_schemes import SCALE_DTYPES, FolderScheme, LinearScheme
from dbr_quant.checkpoints.layout import model_modules, own_tensors
from dbr_quant.checkpoints.safetensors_io import StoredTensor, read_tensor
from dbr_quant.moe.experts import EXPERTS, MoeState
from dbr_quant.ops.mappings import LINEAR, SDPA
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.qconfig import Override, QConfig, TensorQConfig

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
Expected = dict[str, tuple[tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]]  # name → (dtypes, shapes)


class FolderPlan:
    """What a foreign folder holds for a model, checked: the FP8 linears with their schemes and tensor names,
    the attention modules with k/v scales, and every tensor expected."""

    def __init__(self, model: nn.Module, scheme: FolderScheme, stored: dict[str, StoredTensor],
                 recalibrate: bool = False, renames: foreign_experts.Renames | None = None) -> None:
        self.scheme, self.stored, self.recalibrate = scheme, stored, recalibrate
        self.linears: dict[str, LinearScheme] = {}
        self.weight_scale: dict[str, str] = {}  # FP8 linear → its weight scale's tensor name
        self.input_scale: dict[str, str] = {}  # FP8 linear with static inputs → its input scale's tensor name
        self.kv: dict[str, tuple[str, str]] = {}  # attention module → (k scale, v scale) tensor names
        self.overrides: list[Override] = []
        # MoE experts modules the file holds per expert (foreign_experts.py), and the 3-D parameters they replace
        self.experts = foreign_experts.find(model, stored, scheme, renames or [])
        self.expected, self.replaced = foreign_experts.expected(self.experts, stored)
        modules = dict(model_modules(model))
        self._linears(modules)
        self._kv(modules)
        self._rest(model)

    def _name(self, fqn: str, pname: str) -> str:
        return f"{fqn}.{pname}" if fqn else pname

    def _first(self, fqn: str, names: tuple[str, ...]) -> str:
        """The first of ``names`` (relative to ``fqn``) the file holds; the first name if none."""
        return next((self._name(fqn, n) for n in names if self._name(fqn, n) in self.stored), self._name(fqn, names[0]))

    def _linears(self, modules: dict[str, nn.Module]) -> None:
        s = self.scheme
        for name, t in sorted(self.stored.items()):
            fp8_weight = (name == "weight" or name.endswith(".weight")) and t.dtype in _FP8_DTYPES
            if not fp8_weight or name in self.expected:  # (an expert's: foreign_experts)
                continue
            fqn = name.removesuffix("weight").removesuffix(".")
            mod = modules.get(fqn)
            if t.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{name}: {t.dtype} weights; dbr_quant reads the E4M3 FP8 weights of the "
                                      f"{s.tool} format")
            if not isinstance(mod, nn.Linear) or not isinstance(mod.weight, torch.Tensor) or mod.weight.dim() != 2:
                raise CheckpointError(f"{name}: an FP8 weight in the checkpoint, but the model has no nn.Linear "
                                      f"'{fqn}'; build the architecture the checkpoint was made from")
            if s.ignored(fqn, mod):
                raise CheckpointError(f"{name}: FP8 in the file, but {s.where} lists '{fqn}' as kept in high "
                                      "precision (ignore / modules_to_not_convert); the folder contradicts its config")
            ls = s.scheme_of(fqn, mod)
            if ls is None:
                raise CheckpointError(f"{name}: FP8 in the file, but no entry of {s.where} targets '{fqn}'")
            self.overrides.append(ls.override(fqn, s.where, self.recalibrate))  # refuses what it cannot run
            out, inp = mod.weight.shape
            self.linears[fqn] = ls
            self.expected[name] = ((torch.float8_e4m3fn,), ((out, inp),))
            scale = self.weight_scale[fqn] = self._first(fqn, ls.weight.scale_names)
            self.expected[scale] = (SCALE_DTYPES, ls.weight.scale_shapes(out, inp))
            if ls.activation is not None and not ls.activation.dynamic:
                inp_scale = self.input_scale[fqn] = self._first(fqn, ls.activation.scale_names)
                self.expected[inp_scale] = (SCALE_DTYPES, ((), (1,)))

    def _kv(self, modules: dict[str, nn.Module]) -> None:
        kv = self.scheme.kv_cache
        if kv is None:
            return
        k_name, v_name = kv.names
        for fqn in modules:
            k, v = self._name(fqn, k_name), self._name(fqn, v_name)
            if k in self.stored or v in self.stored:
                self.kv[fqn] = (k, v)
                self.expected[k] = self.expected[v] = (SCALE_DTYPES, ((), (1,)))
        if not self.kv:
            raise CheckpointError(f"{self.scheme.where} has a KV-cache scheme but the folder holds no "
                                  f"'{k_name}' / '{v_name}' tensor of any module of this model")

    def _rest(self, model: nn.Module) -> None:
        first: dict[int, str] = {}
        for fqn, mod in model_modules(model):
            for pname, t in own_tensors(mod):
                name = self._name(fqn, pname)
                if name in self.expected or name in self.replaced:
                    continue
                tied = id(t) in first
                first.setdefault(id(t), name)
                if tied and name not in self.stored:  # tied weights are written once
                    continue
                self.expected[name] = (SCALE_DTYPES if t.dtype.is_floating_point else (t.dtype,), (tuple(t.shape),))

    def check(self) -> None:
        tool = self.scheme.tool
        for name, (dtypes, shapes) in self.expected.items():
            t = self.stored.get(name)
            if t is None:
                raise CheckpointError(f"{name}: missing from the {tool} checkpoint (the model needs shape "
                                      f"{list(shapes[0])}); is this the checkpoint of this architecture?")
            if t.dtype not in dtypes or t.shape not in shapes:
                fqn = name.rpartition(".")[0]
                ls = self.linears.get(fqn)
                block = ls is not None and name == self.weight_scale.get(fqn) and ls.weight.block is not None
                hint = (f" (the {ls.weight.block[0]}×{ls.weight.block[1]} block grid of the "
                        f"{list(self.expected[self._name(fqn, 'weight')][1][0])} weight)"
                        if block and ls is not None and ls.weight.block is not None else "")
                raise CheckpointError(f"{name}: the checkpoint holds {str(t.dtype).removeprefix('torch.')} "
                                      f"{list(t.shape)}, the model needs {list(shapes[0])}{hint}; this "
                                      f"{'block scale' if block else 'tensor'} does not match the {tool} layout of "
                                      "this architecture")
        unexpected = sorted(set(self.stored) - set(self.expected))
        for name in unexpected:
            fqn, _, pname = name.rpartition(".")
            if "scale" in pname and self._name(fqn, "weight") in self.stored:
                raise CheckpointError(f"{name}: a scale for '{self._name(fqn, 'weight')}', which the file holds as "
                                      f"{str(self.stored[self._name(fqn, 'weight')].dtype).removeprefix('torch.')}, "
                                      "not as an FP8 weight with this scheme (wrong dtype, or a scale the config does "
                                      "not describe)")
        if unexpected:
            raise CheckpointError(f"{unexpected[0]}: in the checkpoint but not in the model ({len(unexpected)} such "
                                  "tensor(s)); build the architecture the checkpoint was made from")

    def read(self) -> dict[str, torch.Tensor]:
        """Every expected tensor, read one at a time, scales checked."""
        values = {name: read_tensor(self.stored[name]) for name in self.expected if name in self.stored}
        scales = [*self.weight_scale.values(), *self.input_scale.values(), *(n for kv in self.kv.values() for n in kv)]
        for name in scales:
            assemble.check_scale(name, values[name])
        for fqn in self.linears:
            assemble.check_fp8_weight(self._name(fqn, "weight"), values[self._name(fqn, "weight")])
        for name, (dtypes, _) in foreign_experts.expected(self.experts, self.stored)[0].items():
            if dtypes == (torch.float8_e4m3fn,):
                assemble.check_fp8_weight(name, values[name])
            elif name.endswith("scale") or name.endswith("scale_inv"):
                assemble.check_scale(name, values[name])
        return values

    def qconfig(self, experts: tuple[Override, ...] = ()) -> QConfig:
        """The listed linears (and ``experts``' overrides) as the file says, FP8 attention where k/v scales are,
        nothing else in FP8."""
        kv = [Override(pattern=rf"^{re.escape(fqn)}\.{SDPA}$", activation=TensorQConfig(),
                       dynamic=False) for fqn in self.kv]
        rest = Override(pattern="", skip=True)
        weight_only = {fqn for fqn, ls in self.linears.items() if ls.activation is None}
        if weight_only and (len(weight_only) < len(self.linears) or self.kv):
            other = next(iter(sorted(set(self.linears) - weight_only)), None)
            raise CheckpointError(
                f"{self.scheme.where}: '{sorted(weight_only)[0]}' is weight-only FP8 (no input_activations) but "
                + (f"'{other}' quantizes its inputs" if other is not None else "k/v cache scales are given")
                + "; dbr_quant's weight-only mode is model-wide (QConfig(weight_only=True)): load a folder of one kind")
        return QConfig(quantize_attention=bool(self.kv), weight_only=bool(weight_only),
                       overrides=(*self.overrides, *experts, *kv, rest))


def _default_example(model: nn.Module) -> tuple[tuple, dict]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if getattr(model, "main_input_name", None) == "input_ids" and isinstance(vocab, int) and vocab > 1:
        return (), {"input_ids": (torch.arange(8) % (vocab - 1) + 1).reshape(1, 8)}
    raise CheckpointError("a checkpoint of another tool has no example inputs: pass example_inputs= / "
                          "example_kwargs= to load_pretrained (what the model's forward takes)")


def _traced(states: list[AutoQuantizationState]) -> tuple[set[str], set[str]]:
    """(linear modules every traced call of which runs in FP8 and experts modules that run in FP8, modules whose
    SDPA runs in FP8)."""
    ops: dict[str, list[SeenOp]] = {}
    attention: set[str] = set()
    for st in states:
        if isinstance(st, MoeState) and st.quantized:
            ops[st.fqn] = list(st.seen_ops)
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_owner is not None:
                ops.setdefault(op.weight_owner, []).append(op)
            elif op.kind == SDPA and op.quantize:
                attention.add(st.fqn)
    return {fqn for fqn, calls in ops.items() if all(op.quantize for op in calls)}, attention


def load_foreign(folder: Path, model: nn.Module, scheme: FolderScheme, stored: dict[str, StoredTensor],
                 example_inputs: Any, example_kwargs: dict[str, Any] | None, recalibrate: bool = False) -> nn.Module:
    """A converted model running the folder's FP8 linears (and attention with k/v scales) with dbr_quant's
    kernels, built as ``load.py`` builds one (``assemble.py``): FP8 weights placed as read, static scales from
    the folder, no calibration, ``model`` untouched. ``recalibrate``: the model prepared instead, every FP8
    linear with a static per-tensor input observer, for ``dbr_quant.calibrate`` then ``dbr_quant.convert``
    (which keeps the FP8 weights as read): a dynamic-activation checkpoint turned into a static one."""
    stored, renames = foreign_experts.model_names(model, stored)
    try:
        plan = FolderPlan(model, scheme, stored, recalibrate, renames)
        plan.check()
        values = plan.read()
        experts: dict[str, foreign_experts.Stacked] = {}
        for fqn, x in plan.experts.items():  # (a loop: stack's warning names load_pretrained's caller)
            experts[fqn] = foreign_experts.stack(x, values, stored, scheme.where, recalibrate)
    except CheckpointError as e:
        raise foreign_experts.file_names(e, renames) from None
    fp8_experts = [fqn for fqn, x in plan.experts.items() if x.scheme is not None]
    if not plan.linears and not fp8_experts:
        raise CheckpointError(f"{folder}: no E4M3 'weight' tensor, nothing to load as FP8")
    qconfig = plan.qconfig(tuple(o for x in experts.values() for o in x.overrides))
    if example_inputs is None and example_kwargs is None:
        args, kwargs = _default_example(model)
    else:
        args, kwargs = example_args(example_inputs, example_kwargs)
    skeleton = Skeleton(model)
    for fqn, ls in plan.linears.items():
        skeleton.put_fp8(f"{fqn}.weight" if fqn else "weight", values.pop(f"{fqn}.weight" if fqn else "weight"),
                         ls.weight.as_fp8_weight_scale(values.pop(plan.weight_scale[fqn])), False, ls.weight.block)
    for fqn, stacked in experts.items():
        x = plan.experts[fqn]
        for pname, (q, scale, bias) in stacked.params.items():
            if x.scheme is None or scale is None:
                skeleton.put(f"{fqn}.{pname}", q)
            else:
                skeleton.put_fp8(f"{fqn}.{pname}", q, scale, x.spec.transposed, x.scheme.weight.block)
            if bias is not None:
                skeleton.put(f"{fqn}.{pname}_bias", bias)
    for name in list(skeleton.slots):
        if name in values:
            skeleton.put(name, values[name])
    skeleton.check_complete()
    if example_inputs is None and example_kwargs is None:
        args, kwargs = on_model_device(skeleton.model, args, kwargs)
    prepared = trace(skeleton.model, args, kwargs, qconfig)
    fp8, attention = _traced(prepared.__dict__["_dbr_record"].states)
    lost = sorted(set(plan.linears) - fp8)
    if lost:
        raise CheckpointError(f"'{lost[0]}': an FP8 linear in the checkpoint, but the trace runs it in high "
                              "precision (the example inputs did not run it?); pass example inputs that do")
    for st in prepared.__dict__["_dbr_record"].states:
        if isinstance(st, MoeState) and st.fqn in fp8_experts and not st.quantized:
            raise CheckpointError(f"'{st.fqn}': FP8 experts in the checkpoint, but dbr_quant's MoE block cannot run "
                                  f"them: {st.spec.reason or st.seen_ops[0].reason}")
    no_sdpa = sorted(set(plan.kv) - attention)
    if no_sdpa:
        raise CheckpointError(f"'{no_sdpa[0]}': the checkpoint has its k/v scales, but its forward runs no "
                              "F.scaled_dot_product_attention (build the model with attn_implementation='sdpa')")
    if recalibrate:
        return prepared

    def scale_of(st: AutoQuantizationState, op: SeenOp, slot: str) -> torch.Tensor | None:
        inputs = experts[st.fqn].inputs if op.kind == EXPERTS and st.fqn in experts else None
        if inputs is not None:
            return inputs[op.index]
        if op.kind == LINEAR and op.weight_owner in plan.input_scale:
            return values[plan.input_scale[op.weight_owner]].float().reshape(())
        if op.kind == SDPA and st.fqn in plan.kv:
            k, v = plan.kv[st.fqn]
            return {"q": torch.ones(()), "k": values[k].float().reshape(()), "v": values[v].float().reshape(())}[slot]
        return None

    return finish_convert(prepared, scale_of)
