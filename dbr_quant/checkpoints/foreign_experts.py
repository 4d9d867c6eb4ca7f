"""MoE experts in FP8 folders of other tools (compressed-tensors, the Hub's ``fp8``): one entry per expert and
projection, loaded into a model whose experts are one module with 3-D weights (transformers 5 ``MixtralExperts``,
``Qwen2MoeExperts``, …), run by dbr_quant's FP8 MoE block (``dbr_quant.moe``).

The layout, as the loaders that read it name it:

* vLLM ``model_executor/layers/fused_moe/layer.py`` ``FusedMoE.make_expert_params_mapping``: a file tensor
  ``…experts.<e>.<ckpt name>.<suffix>`` goes to expert ``e`` of ``w13_<suffix>`` (gate = shard ``w1`` rows
  [0, I), up = ``w3`` rows [I, 2I)) or ``w2_<suffix>`` (down); the ckpt names are ``w1``/``w3``/``w2`` in
  ``models/mixtral.py`` (the MoE block is ``block_sparse_moe``) and ``gate_proj``/``up_proj``/``down_proj`` in
  ``models/qwen2_moe.py`` & co. (transformers ``conversion_mapping.py`` merges the same names into
  ``gate_up_proj`` / ``down_proj`` and renames Mixtral's ``.block_sparse_moe.`` to ``.mlp.``). Both name sets
  are accepted under either block name: what the file holds decides.
* Per projection: ``weight`` E4M3 [out, in]; ``weight_scale`` (``weight_scale_inv`` in the Hub's ``fp8``) of the
  format's linear layout (0-d / [1] per tensor, [out, 1] per channel, the block grid); ``input_scale`` [1] when
  static. The folder's config describes the experts as the ``Linear`` layers they were when it was written, so
  its targets and ignore list are matched on the file's names with an ``nn.Linear``.

Into dbr_quant's layout (``moe/weights.py``: qdata [E, N, K], the module's own ``transposed``):

* per-tensor weight scales: one per expert when each expert's gate and up scales are equal; else (llm-compressor
  observes gate and up separately) one per output channel, each row keeping its own projection's scale — the
  same dequantized values, exactly (vLLM instead re-quantizes w13 to the larger of the two:
  ``compressed_tensors_moe_w8a8_fp8.py`` ``process_weights_after_loading``);
* static input scales: dbr_quant quantizes the block's hidden states once for every expert, with the largest of
  the file's gate / up input scales (what vLLM does: "Found input_scales that are not equal for fp8 MoE layer.
  Using the maximum across experts for each layer", a warning here too); the down input keeps one scale per
  expert, as the file holds it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.experts import block_renames, rename
from dbr_quant.checkpoints.foreign_schemes import SCALE_DTYPES, FolderScheme, LinearScheme
from dbr_quant.checkpoints.layout import model_modules
from dbr_quant.checkpoints.safetensors_io import StoredTensor
from dbr_quant.moe.experts import ExpertsSpec, experts_spec
from dbr_quant.qconfig import Override

Expected = dict[str, tuple[tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]]
_NAMES = {True: (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")), False: (("w1", "w2"),
                                                                                   ("up_proj", "down_proj"))}
_LINEAR = nn.Linear(1, 1, device="meta")  # what the config's "Linear" targets meant when the folder was written


Renames = list[tuple[str, str]]


def model_names(model: nn.Module, stored: dict[str, StoredTensor]) -> tuple[dict[str, StoredTensor], Renames]:
    """The folder's tensors under the model's names, and the (model prefix, file prefix) renames: a Mixtral MoE
    block stored as ``block_sparse_moe`` (the Hub's Mixtral checkpoints) is the model's ``mlp``."""
    fqns = [fqn for fqn, mod in model_modules(model) if experts_spec(mod) is not None]
    renames = [(m, f) for m, f in block_renames(model, fqns) if any(n.startswith(f) for n in stored)]
    return ({rename(n, renames, reverse=True): t for n, t in stored.items()} if renames else stored), renames


def file_names(error: CheckpointError, renames: Renames) -> CheckpointError:
    """``error`` naming the folder's tensors (``block_sparse_moe``), not the model's (``mlp``)."""
    message = str(error)
    for model_prefix, file_prefix in renames:
        message = message.replace(model_prefix, file_prefix)
    return CheckpointError(message) if renames else error


@dataclass
class ExpertsFile:
    """One experts module as the folder holds it: per-expert projections (file names ``names``, gate/up/down or
    up/down), their scheme, and the tensor names of each (expert, projection)."""

    fqn: str
    spec: ExpertsSpec
    names: tuple[str, ...]
    scheme: LinearScheme | None  # None: high-precision experts
    shapes: tuple[tuple[int, int], ...]  # [out, in] per projection

    def tensor(self, e: int, proj: str, key: str) -> str:
        return f"{self.fqn}.{e}.{proj}.{key}"

    def scale(self, e: int, proj: str, stored: dict[str, StoredTensor]) -> str:
        assert self.scheme is not None
        names = self.scheme.weight.scale_names
        return next((self.tensor(e, proj, n) for n in names if self.tensor(e, proj, n) in stored),
                    self.tensor(e, proj, names[0]))

    def input_scale(self, e: int, proj: str, stored: dict[str, StoredTensor]) -> str | None:
        a = None if self.scheme is None else self.scheme.activation
        if a is None or a.dynamic:
            return None
        return next((self.tensor(e, proj, n) for n in a.scale_names if self.tensor(e, proj, n) in stored),
                    self.tensor(e, proj, a.scale_names[0]))

    @property
    def parts(self) -> list[tuple[str, list[str]]]:
        """(3-D parameter name, the projections stacked into it in order)."""
        first, down = self.spec.names
        return [(first, list(self.names[:2])), (down, [self.names[2]])] if self.spec.gated else \
            [(first, [self.names[0]]), (down, [self.names[1]])]


def find(model: nn.Module, stored: dict[str, StoredTensor], scheme: FolderScheme,
         renames: Renames) -> dict[str, ExpertsFile]:
    """The experts modules of ``model`` the folder holds per expert (model names; ``renames`` to the file's, which
    the config's targets name), their scheme checked to be one for every projection and expert."""
    found: dict[str, ExpertsFile] = {}
    for fqn, mod in model_modules(model):
        spec = experts_spec(mod)
        if spec is None:
            continue
        names = next((n for n in _NAMES[spec.gated] if f"{fqn}.0.{n[0]}.weight" in stored), None)
        if names is None:
            continue
        w1, w2 = spec.weights(mod)
        n1, k1 = (w1.shape[2], w1.shape[1]) if spec.transposed else (w1.shape[1], w1.shape[2])
        n2, k2 = (w2.shape[2], w2.shape[1]) if spec.transposed else (w2.shape[1], w2.shape[2])
        shapes = ((n1 // 2, k1), (n1 // 2, k1), (n2, k2)) if spec.gated else ((n1, k1), (n2, k2))
        first = stored[f"{fqn}.0.{names[0]}.weight"]
        fp8 = first.dtype == torch.float8_e4m3fn
        schemes: dict[LinearScheme | None, str] = {}
        for e in range(spec.num_experts):
            for proj in names:
                name = f"{fqn}.{e}.{proj}.weight"
                t = stored.get(name)
                if t is not None and (t.dtype == torch.float8_e4m3fn) != fp8:
                    raise CheckpointError(f"{name}: {t.dtype}, but {fqn}.0.{names[0]}.weight is {first.dtype}; "
                                          "dbr_quant runs an experts module all in FP8 or all in high precision")
                file_fqn = rename(f"{fqn}.{e}.{proj}", renames)
                ls = scheme.scheme_of(file_fqn, _LINEAR) if fp8 and not scheme.ignored(file_fqn, _LINEAR) else None
                if fp8 and ls is None:
                    raise CheckpointError(f"{name}: FP8 in the file, but no entry of {scheme.where} targets "
                                          f"'{file_fqn}' (or it is in the ignore list)")
                schemes.setdefault(ls, name)
        if len(schemes) > 1:
            a, b = list(schemes.values())[:2]
            raise CheckpointError(f"{b}: another FP8 scheme than {a} in {scheme.where}; dbr_quant runs one experts "
                                  "module with one scheme")
        found[fqn] = ExpertsFile(fqn, spec, names, next(iter(schemes)), shapes)
    return found


def expected(found: dict[str, ExpertsFile], stored: dict[str, StoredTensor]) -> tuple[Expected, set[str]]:
    """(tensor name → (dtypes, shapes) of every per-expert tensor, the 3-D parameter names they replace)."""
    out: Expected = {}
    replaced: set[str] = set()
    for x in found.values():
        for pname, _ in x.parts:
            replaced |= {f"{x.fqn}.{pname}", f"{x.fqn}.{pname}_bias"}
        for e in range(x.spec.num_experts):
            for proj, (n, k) in zip(x.names, x.shapes):
                w = x.tensor(e, proj, "weight")
                if x.scheme is None:
                    out[w] = (SCALE_DTYPES, ((n, k),))
                else:
                    out[w] = ((torch.float8_e4m3fn,), ((n, k),))
                    out[x.scale(e, proj, stored)] = (SCALE_DTYPES, x.scheme.weight.scale_shapes(n, k))
                    inp = x.input_scale(e, proj, stored)
                    if inp is not None:
                        out[inp] = (SCALE_DTYPES, ((), (1,)))
                if x.spec.has_bias:
                    out[x.tensor(e, proj, "bias")] = (SCALE_DTYPES, ((n,),))
    return out, replaced


@dataclass(frozen=True)
class Stacked:
    """One experts module in dbr_quant's layout: per 3-D parameter (qdata or high-precision weight, FP8Weight
    scale, bias); the static input scales (gate_up: one, down: [E]); its override per parameter."""

    params: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    inputs: tuple[torch.Tensor, torch.Tensor] | None
    overrides: tuple[Override, ...]


def stack(x: ExpertsFile, values: dict[str, torch.Tensor], stored: dict[str, StoredTensor], where: str,
          recalibrate: bool) -> Stacked:
    """The per-expert tensors of ``x`` popped from ``values`` and stacked (one module's experts held twice at
    most)."""
    E = x.spec.num_experts
    ls = x.scheme
    per_channel = False
    if ls is not None and ls.weight.granularity == "tensor":  # gate and up of an expert with different scales
        per_channel = any(not torch.equal(*(values[x.scale(e, p, stored)].float().reshape(()) for p in projs))
                          for _, projs in x.parts if len(projs) == 2 for e in range(E))
    params: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
    for pname, projs in x.parts:
        q = torch.stack([torch.cat([values.pop(x.tensor(e, p, "weight")) for p in projs]) for e in range(E)])
        bias = (torch.stack([torch.cat([values.pop(x.tensor(e, p, "bias")) for p in projs]) for e in range(E)])
                if x.spec.has_bias else None)
        if ls is None:
            params[pname] = (q.transpose(1, 2).contiguous() if x.spec.transposed else q, None, bias)
            continue
        rows = [[(values.pop(x.scale(e, p, stored)).float(), n) for p, (n, _) in zip(projs, _shapes(x, projs))]
                for e in range(E)]
        params[pname] = (q, torch.stack([_scale(ls, r, per_channel) for r in rows]), bias)
    inputs = None
    if ls is not None and ls.activation is not None and not ls.activation.dynamic and not recalibrate:
        (_, first), (_, down) = x.parts
        ins = torch.stack([values[s].float().reshape(()) for e in range(E) for p in first
                           if (s := x.input_scale(e, p, stored)) is not None])
        if not bool((ins == ins[0]).all()):
            # stacklevel 4: load_pretrained's caller (stack ← load_foreign ← load_pretrained)
            warnings.warn(f"dbr_quant.load_pretrained: '{x.fqn}': the experts' gate/up input scales differ "
                          f"({float(ins.min()):.4g} … {float(ins.max()):.4g}); the block's hidden states are quantized "
                          "once for every expert, with the largest (what vLLM does)", stacklevel=4)
        downs = torch.stack([values[s].float().reshape(()) for e in range(E) for p in down
                             if (s := x.input_scale(e, p, stored)) is not None])
        inputs = (ins.amax(), downs)
    overrides: tuple[Override, ...] = ()
    if ls is not None:
        w = dataclasses.replace(ls.weight, granularity="channel") if per_channel else ls.weight
        overrides = tuple(dataclasses.replace(ls, weight=w).override(f"{x.fqn}.{p}", where, recalibrate)
                          for p, _ in x.parts)
    return Stacked(params, inputs, overrides)


def _shapes(x: ExpertsFile, projs: list[str]) -> list[tuple[int, int]]:
    return [x.shapes[x.names.index(p)] for p in projs]


def _scale(ls: LinearScheme, rows: list[tuple[torch.Tensor, int]], per_channel: bool) -> torch.Tensor:
    """One expert's FP8Weight scale of a 3-D parameter from its projections' file scales (gate then up):
    [1] per expert, [N] per channel (a per-tensor scale repeated over its rows when ``per_channel``), or the
    block grids stacked [gate row blocks + up row blocks, K blocks]."""
    g = ls.weight.granularity
    if g == "block":
        return torch.cat([s for s, _ in rows])
    if g == "channel" or per_channel:
        return torch.cat([s.reshape(-1).expand(n) if g == "tensor" else s.reshape(-1) for s, n in rows])
    return rows[0][0].reshape(1)
