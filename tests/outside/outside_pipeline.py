"""The pipeline every outside case runs through, and the checks a foreign suite makes of its result."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from outside_models import Case
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight

REL_L2 = 0.1  # FP8 E4M3 (3 mantissa bits) through two or three layers: a few % relative L2 error
GEMM_KERNELS = ("fp8_linear", "fp8_mlp", "fp8_gated_mlp", "fp8_matmul")


def call(model: nn.Module, inputs: tuple[tuple, dict]) -> Any:
    args, kwargs = inputs
    return model(*args, **kwargs)


def converted_case(case: Case, calib_batches: int = 4) -> tuple[nn.Module, nn.Module]:
    """(fp32 model, converted model): prepare on one batch, calibrate on others, convert."""
    torch.manual_seed(0)
    model = case.build().eval()
    g = torch.Generator().manual_seed(1)
    example = case.inputs(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stays high precision" notes are checked through report()
        prepared = dq.prepare(model, example[0], case.qconfig, example_kwargs=example[1])
        batches = [case.inputs(g) for _ in range(calib_batches)]
        if any(args and kwargs for args, kwargs in batches):  # calibrate() takes one or the other:
            with torch.no_grad():  # any forward of a prepared model calibrates
                for batch in batches:
                    call(prepared, batch)
        else:
            dq.calibrate(prepared, [kwargs or args for args, kwargs in batches], progress=False)
        return model, dq.convert(prepared)


def eval_inputs(case: Case, seed: int = 2) -> tuple[tuple, dict]:
    return case.inputs(torch.Generator().manual_seed(seed))


def leaves(out: Any, path: str = "out") -> list[tuple[str, Any]]:
    """Every leaf of a (nested) output with its path: tuples, lists, dicts, namedtuples, dataclasses."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [leaf for f in dataclasses.fields(out) for leaf in leaves(getattr(out, f.name), f"{path}.{f.name}")]
    if isinstance(out, dict):
        return [leaf for k, v in out.items() for leaf in leaves(v, f"{path}[{k!r}]")]
    if isinstance(out, (tuple, list)):
        return [leaf for i, v in enumerate(out) for leaf in leaves(v, f"{path}[{i}]")]
    return [(path, out)]


def structure(out: Any) -> Any:
    """The output's shape of containers and non-tensor leaves (types, keys, python values)."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return (type(out), tuple((f.name, structure(getattr(out, f.name))) for f in dataclasses.fields(out)))
    if isinstance(out, dict):
        return (type(out), tuple((k, structure(v)) for k, v in out.items()))
    if isinstance(out, (tuple, list)):
        return (type(out), tuple(structure(v) for v in out))
    if isinstance(out, torch.Tensor):
        return (torch.Tensor, out.dtype, tuple(out.shape))
    return out


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def assert_close_to_fp32(got: Any, want: Any, what: str) -> None:
    """Same structure; every float tensor within FP8's error of fp32; at least one not bit-equal (FP8 ran)."""
    assert structure(got) == structure(want), f"{what}: output structure differs from the fp32 model's"
    changed = False
    for (path, g), (_, w) in zip(leaves(got), leaves(want)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            assert g is w or torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w, f"{what}: {path}"
            continue
        assert torch.isfinite(g).all(), f"{what}: {path} has non-finite values"
        err = rel_l2(g, w)
        assert err < REL_L2, f"{what}: {path} relative L2 error {err:.4f} vs fp32 (bound {REL_L2})"
        changed |= not torch.equal(g, w)
    assert changed, f"{what}: every output equals fp32 bit for bit — FP8 did not run"


def assert_fp8_weights(converted: nn.Module, fqns: tuple[str, ...]) -> None:
    """Each listed module holds an FP8 weight and the report says it runs in FP8."""
    rows = dq.report(converted)
    for fqn in fqns:
        w = converted.get_submodule(fqn).weight
        assert isinstance(w, FP8Weight) and w.qdata.dtype in (torch.float8_e4m3fn, torch.float8_e5m2), \
            f"{fqn}: weight is {type(w).__name__} {getattr(w, 'dtype', None)}, not FP8\n{dq.format_report(rows)}"
        mine = [r for r in rows if r["fqn"] == fqn or r["fqn"].startswith(fqn + ".") or r["fqn"].startswith(fqn + "[")]
        assert mine and all(r["fp8"] for r in mine), f"{fqn}: report rows {mine}\n{dq.format_report(rows)}"


def fp8_gemm_launches(model: nn.Module, inputs: tuple[tuple, dict]) -> int:
    with dq.kernels.count_launches() as counts:
        call(model, inputs)
    return sum(n for k, n in counts.items() if any(g in k for g in GEMM_KERNELS))


@dataclasses.dataclass
class Snapshot:
    """What a user's model looks like: its tensors, each module's attributes and hooks, and its class."""
    state: dict[str, torch.Tensor]
    attrs: dict[str, tuple[str, ...]]
    hooks: dict[str, tuple[int, ...]]
    classes: dict[str, str]  # by name: parametrize creates a class per instance

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            state={k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
            attrs={n: tuple(sorted(m.__dict__)) for n, m in model.named_modules(remove_duplicate=False)},
            hooks={n: tuple(len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks"))
                   for n, m in model.named_modules(remove_duplicate=False)},
            classes={n: type(m).__qualname__ for n, m in model.named_modules(remove_duplicate=False)},
        )

    def assert_same(self, model: nn.Module) -> None:
        now = Snapshot.of(model)
        assert now.attrs == self.attrs, "a module of the user's model gained or lost attributes"
        assert now.hooks == self.hooks and now.classes == self.classes
        assert now.state.keys() == self.state.keys()
        for k, v in self.state.items():
            assert type(now.state[k]) is type(v) and torch.equal(now.state[k], v), f"user's {k} changed"
