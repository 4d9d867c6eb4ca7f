"""Small models written the way a foreign suite writes them (PyTorch's define-by-run int8 test models, new
users' first tries): aliasing, reuse, in-place and functional ops, containers, control flow, hooks, kwargs
and structured outputs, torch's own nn layers. Each ``Case`` says which linear weights must end up FP8, so a
model that silently stays fp32 cannot pass as "close to fp32"."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant import QConfig
from dbr_quant.fx_rewriter import RewriteError

D = 16  # feature width of every toy


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[tuple, dict]]  # (args, kwargs), a fresh batch per call
    fp8: tuple[str, ...]  # fqns of the modules whose weight convert must store in FP8
    marks: tuple = ()  # on every test of the case
    rewrite_marks: tuple = ()  # on the rewrite / compile tests only
    qconfig: Any = None

    def param(self, rewritten: bool = False) -> Any:
        return pytest.param(self, id=self.name, marks=self.marks + (self.rewrite_marks if rewritten else ()))


def x2d(batch: int = 4) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    return lambda g: ((torch.randn(batch, D, generator=g),), {})


def x3d(batch: int = 2, seq: int = 5) -> Callable[[torch.Generator], tuple[tuple, dict]]:
    return lambda g: ((torch.randn(batch, seq, D, generator=g),), {})


def lin(bias: bool = True) -> nn.Linear:
    return nn.Linear(D, D, bias=bias)


# ---------------------------------------------------------------------- aliasing, a tensor consumed twice
class AliasAdd(nn.Module):  # the DBR suite's `y = lin(x); z = y; return y + z`
    def __init__(self) -> None:
        super().__init__()
        self.lin = lin()

    def forward(self, x):
        y = self.lin(x)
        z = y
        return y + z


class TorchAddSelf(AliasAdd):
    def forward(self, x):
        y = self.lin(x)
        return torch.add(y, y)


class MethodAddSelf(AliasAdd):
    def forward(self, x):
        y = self.lin(x)
        return y.add(y)


class AliasMulSelf(AliasAdd):  # a square, not a residual: no fusion claims it
    def forward(self, x):
        y = self.lin(x)
        return y * y


class ConsumedTwice(nn.Module):  # y feeds a linear and a mul: no fusion may swallow y
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        y = self.a(x)
        return self.b(y) * y


class TwoHeads(nn.Module):  # one activation quantized for two linears
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = lin(), lin(), lin()

    def forward(self, x):
        y = F.gelu(self.a(x))
        return self.b(y) + self.c(y)


class ReturnsIntermediate(nn.Module):  # an intermediate of a would-be MLP fusion is returned too
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        h = F.relu(self.a(x))
        return h, self.b(h)


class ResidualOfInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, x):
        return x + self.a(x)


# ---------------------------------------------------------------------- in-place ops
class InplaceAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        y = self.a(x)
        y += x
        return self.b(y)


class InplaceRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = lin(), lin(), lin()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.a(x).relu_()
        y = self.act(self.b(y))
        return F.relu(self.c(y), inplace=True)


class InplaceMulAfterLinear(nn.Module):  # an in-place op on a linear's output between two linears
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        y = self.a(x)
        y.mul_(0.5).add_(1.0)
        return self.b(y)


class InplaceOnInputClone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, x):
        x = x.clone()
        x[:, 0] = 0.0  # setitem
        return self.a(x)


# ---------------------------------------------------------------------- functional ops
class FunctionalLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.b = nn.Parameter(torch.zeros(D))
        self.out = lin()

    def forward(self, x):
        return self.out(F.relu(F.linear(x, self.w, self.b)))


class CatStackChunkSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()
        self.c = nn.Linear(2 * D, 2 * D)

    def forward(self, x):
        h = torch.cat([self.a(x), self.b(x)], dim=-1)
        c1, c2 = h.chunk(2, dim=-1)
        s = torch.stack([c1, c2]).sum(0)
        p, q = self.c(torch.cat([s, x], -1)).split(D, dim=-1)
        return p * torch.sigmoid(q)


class ViewsAndTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 2 * D)
        self.b = lin()

    def forward(self, x):  # x: [B, S, D]
        y = self.a(x).view(x.shape[0], x.shape[1], 2, D).transpose(1, 2).contiguous()
        y = y.mean(1)
        return self.b(y.permute(0, 1, 2).reshape(-1, D)).reshape(x.shape)


class WhereMaskEinsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = lin(), lin(), lin()

    def forward(self, x):  # x: [B, S, D]
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = torch.einsum("bsd,btd->bst", q, k) / D**0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        p = s.masked_fill(causal, float("-inf")).softmax(-1)
        o = torch.einsum("bst,btd->bsd", p, v)
        return torch.where(o > 0, o, 0.1 * o)


class HandSDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.o = lin()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, D))


class ParamMatmul(nn.Module):  # a parameter used directly as a matmul operand (a LoRA written by hand)
    def __init__(self) -> None:
        super().__init__()
        self.base = lin()
        self.A = nn.Parameter(torch.randn(4, D) / D**0.5)
        self.B = nn.Parameter(torch.randn(D, 4) / 2)

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


# ---------------------------------------------------------------------- containers and reuse
class NestedContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(lin(), nn.GELU(), lin()) for _ in range(2)])
        self.heads = nn.ModuleDict({"left": lin(), "right": nn.Sequential(nn.ModuleList([lin()])[0], nn.Tanh())})

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk(x)
        return {k: head(x) for k, head in self.heads.items()}


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, x):
        return self.a(torch.tanh(self.a(x)))


class SharedAcrossBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared, self.a, self.b = lin(), lin(), lin()

    def forward(self, x):
        left = self.shared(F.relu(self.a(x)))
        right = self.shared(torch.sigmoid(self.b(x)))
        return left - right


class SharedChild(nn.Module):  # one module registered under two parents
    def __init__(self) -> None:
        super().__init__()
        common = lin()
        self.p1 = nn.Sequential(lin(), common)
        self.p2 = nn.Sequential(common, lin())

    def forward(self, x):
        return self.p2(self.p1(x))


class CallsForwardDirectly(nn.Module):  # bypasses __call__: no module call to intercept
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        return self.b(F.relu(self.a.forward(x)))


class _Helpers(nn.Module):
    @staticmethod
    def gate(h: torch.Tensor) -> torch.Tensor:
        return h * torch.sigmoid(h)


def _project(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h)


class StaticAndHelpers(_Helpers):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        return _project(self.b, self.gate(_project(self.a, x)))


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.gate, self.up = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DeepSequential(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(lin(), nn.ReLU(), nn.Dropout(0.1), lin(), nn.GELU(), lin(bias=False), nn.Identity())


# ---------------------------------------------------------------------- control flow, kwargs, outputs
class ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small, self.big = lin(), lin()

    def forward(self, x):
        h = self.small(x) if x.shape[0] <= 4 else self.big(x)  # every batch here takes the same branch
        for _ in range(x.shape[-1] // 8):  # a loop whose trip count comes from a shape
            h = h + 0.1 * self.small(h)
        return h


class PythonFlagKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x, *, scale: float = 1.0, mask: torch.Tensor | None = None, mode: str = "relu"):
        h = self.a(x) * scale
        h = F.relu(h) if mode == "relu" else torch.tanh(h)
        if mask is not None:
            h = h.masked_fill(~mask[..., None], 0.0)
        return self.b(h)


def _flag_inputs(g: torch.Generator) -> tuple[tuple, dict]:
    x = torch.randn(2, 5, D, generator=g)
    return (x,), {"scale": 0.5, "mask": torch.rand(2, 5, generator=g) > 0.3, "mode": "relu"}


Pair = namedtuple("Pair", ["main", "aux"])


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    n: int


class NamedTupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        h = self.a(x)
        return Pair(main=self.b(h), aux=[h.sum(-1), {"h": h}])


class DataclassOut(NamedTupleOut):
    def forward(self, x):
        h = self.a(x)
        return Out(logits=self.b(F.gelu(h)), hidden=(x, h), n=x.shape[0])


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, batch: dict):
        return self.a(batch["x"]) + self.b(batch["y"])


def _dict_inputs(g: torch.Generator) -> tuple[tuple, dict]:
    return ({"x": torch.randn(4, D, generator=g), "y": torch.randn(4, D, generator=g)},), {}


class LinearKwargCall(nn.Module):  # a module called with its argument by keyword
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, x):
        return self.a(input=x)


# ---------------------------------------------------------------------- hooks
def _with_hooks() -> nn.Module:
    m = nn.Sequential(lin(), nn.GELU(), lin(), nn.ReLU(), lin())
    m[0].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    m[2].register_forward_hook(lambda mod, args, out: out + 1.0)
    m[4].register_forward_hook(lambda mod, args, kwargs, out: out * 2.0, with_kwargs=True)
    return m


# ---------------------------------------------------------------------- grad mode, detach, casts, buffers
class NoGradInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
        return self.b(h.detach())


class DtypeCasts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        h = self.a(x).to(torch.bfloat16)
        h = F.gelu(h).float()
        return self.b(h.double().float())


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.linspace(-1, 1, D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.a = lin()

    def forward(self, x):
        return self.a((x - self.mean) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5))


class BF16Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


def _bf16() -> nn.Module:
    return BF16Model().to(torch.bfloat16)


# ---------------------------------------------------------------------- torch's own layers
class Recurrent(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.rnn = kind(D, D, batch_first=True)
        self.head = lin()

    def forward(self, x):
        out = self.rnn(x)[0]
        return self.head(out[:, -1])


class EmbeddingBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.norm = nn.LayerNorm(D)
        self.fc = lin()

    def forward(self, ids):
        return self.fc(self.norm(self.emb(ids)))


def _ids(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randint(0, 50, (2, 7), generator=g),), {}


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(D, D, 3, padding=1)
        self.c2 = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * D, D)

    def forward(self, x):  # x: [B, S, D]
        h = self.c1(x.transpose(1, 2)).transpose(1, 2)  # [B, S, D]
        h = self.c2(h[:, None]).mean(2)  # [B, 4, D]
        return self.fc(h.flatten(1))


class GroupNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(4, D)
        self.fc = lin()

    def forward(self, x):
        return self.fc(self.gn(x))


class LayerNormLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = lin()
        self.ln2 = nn.LayerNorm(D, elementwise_affine=False)
        self.fc2 = lin()

    def forward(self, x):
        return self.fc2(self.ln2(self.fc(self.ln(x))))


class MHA(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        self.batch_first = batch_first

    def forward(self, x):
        x = x if self.batch_first else x.transpose(0, 1)
        out = self.attn(x, x, x, need_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)


def _encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(D, 2, dim_feedforward=32, dropout=0.0, batch_first=True)


CASES: list[Case] = [
    Case("alias_add", AliasAdd, x2d(), ("lin",)),
    Case("torch_add_self", TorchAddSelf, x2d(), ("lin",)),
    Case("method_add_self", MethodAddSelf, x2d(), ("lin",)),
    Case("alias_mul_self", AliasMulSelf, x2d(), ("lin",)),
    Case("consumed_twice", ConsumedTwice, x2d(), ("a", "b")),
    Case("two_heads", TwoHeads, x3d(), ("a", "b", "c")),
    Case("returns_intermediate", ReturnsIntermediate, x2d(), ("a", "b")),
    Case("residual_of_input", ResidualOfInput, x3d(), ("a",)),
    Case("inplace_add", InplaceAdd, x2d(), ("a", "b")),
    Case("inplace_relu", InplaceRelu, x2d(), ("a", "b", "c")),
    Case("inplace_mul_between_linears", InplaceMulAfterLinear, x2d(), ("a", "b")),
    Case("inplace_setitem_input", InplaceOnInputClone, x2d(), ("a",)),
    Case("functional_linear", FunctionalLinear, x2d(), ("out",)),
    Case("cat_stack_chunk_split", CatStackChunkSplit, x2d(), ("a", "b", "c")),
    Case("views_transpose", ViewsAndTranspose, x3d(), ("a", "b")),
    Case("where_maskfill_einsum", WhereMaskEinsum, x3d(), ("q", "k", "v")),
    Case("hand_sdpa", HandSDPA, x3d(), ("qkv", "o")),
    Case("param_matmul_lora", ParamMatmul, x2d(), ("base",)),
    Case("nested_containers", NestedContainers, x3d(),
         ("blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "heads.left", "heads.right.0")),
    Case("called_twice", CalledTwice, x2d(), ("a",)),
    Case("shared_across_branches", SharedAcrossBranches, x2d(), ("shared", "a", "b")),
    Case("shared_child", SharedChild, x2d(), ("p1.0", "p1.1", "p2.1")),
    Case("calls_forward_directly", CallsForwardDirectly, x2d(), ("b",)),
    Case("staticmethod_helpers", StaticAndHelpers, x2d(), ("a", "b")),
    Case("gated_mlp", GatedMLP, x3d(), ("gate", "up", "down")),
    Case("deep_sequential", DeepSequential, x3d(), ("0", "3", "5")),
    Case("shape_branch_loop", ShapeBranch, x2d(), ("small",)),
    Case("python_flag_kwargs", PythonFlagKwargs, _flag_inputs, ("a", "b")),
    Case("namedtuple_out", NamedTupleOut, x2d(), ("a", "b")),
    Case("dataclass_out", DataclassOut, x2d(), ("a", "b"), rewrite_marks=(pytest.mark.xfail(
        raises=RewriteError, strict=True, reason="torch.export cannot return an unregistered dataclass: rewrite() "
        "says to call torch.export.register_dataclass (the user's workaround)"),)),
    Case("dict_input", DictInput, _dict_inputs, ("a", "b")),
    Case("linear_kwarg_call", LinearKwargCall, x2d(), ("a",)),
    Case("forward_hooks", _with_hooks, x2d(), ("0", "2", "4")),
    Case("no_grad_detach_inside", NoGradInside, x2d(), ("a", "b")),
    Case("dtype_casts", DtypeCasts, x2d(), ("a", "b")),
    Case("buffers", Buffers, x2d(), ("a",)),
    Case("bf16_model", _bf16, lambda g: ((torch.randn(4, D, generator=g).bfloat16(),), {}), ("a", "b")),
    Case("lstm_head", lambda: Recurrent(nn.LSTM), x3d(), ("head",)),
    Case("gru_head", lambda: Recurrent(nn.GRU), x3d(), ("head",)),
    Case("embedding_layernorm", EmbeddingBag, _ids, ("fc",)),
    Case("conv1d_conv2d_head", Convs, x3d(), ("fc",)),
    Case("groupnorm", GroupNormNet, x2d(), ("fc",)),
    Case("layernorm_linear", LayerNormLinear, x3d(), ("fc", "fc2")),
    Case("mha_seq_first", lambda: MHA(batch_first=False), x3d(), ("attn.out_proj",)),
    Case("mha_batch_first", lambda: MHA(batch_first=True), x3d(), ("attn.out_proj",)),
    Case("transformer_encoder_layer", _encoder_layer, x3d(), ("linear1", "linear2", "self_attn.out_proj")),
]


# ---------------------------------------------------------------------- second round: what new users write
class WeightNormLinear(nn.Module):  # a parametrized weight: `weight` is a property computed per call
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(lin())
        self.b = lin()

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class SharedWeightFunctional(nn.Module):  # another module's weight used through F.linear (a tied head)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        h = F.gelu(self.a(x))
        return self.b(h) + F.linear(h, self.b.weight)


class SumOfHeads(nn.Module):  # builtin sum over a generator: 0 + tensor first
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([lin() for _ in range(3)])

    def forward(self, x):
        return sum(h(x) for h in self.heads) / len(self.heads)


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, *xs):
        return torch.stack([self.a(x) for x in xs]).mean(0)


class Recursive(nn.Module):  # a module that calls itself with a python depth
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.a = lin()
        self.child = Recursive(depth - 1) if depth > 0 else None

    def forward(self, x, depth: int | None = None):
        h = torch.tanh(self.a(x))
        return h if self.child is None else h + self.child(h)


class AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(F.relu(h.float()))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(lin(), nn.GELU(), lin())
        self.out = lin()

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.out(h)


class OddShapes(nn.Module):  # widths that are no multiple of anything, a 4-D input, a 1-row batch
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 17)
        self.b = nn.Linear(17, 3)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


class LinearSubclass(nn.Linear):  # a LoRA-style subclass with its own forward
    def __init__(self) -> None:
        super().__init__(D, D)
        self.lora_a = nn.Linear(D, 4, bias=False)
        self.lora_b = nn.Linear(4, D, bias=False)

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x))


class WithLinearSubclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = LinearSubclass()
        self.out = lin()

    def forward(self, x):
        return self.out(F.relu(self.proj(x)))


class TransposedParam(nn.Module):  # weight stored [in, out], used as x @ w + b
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.b = nn.Parameter(torch.zeros(D))
        self.out = lin()

    def forward(self, x):
        return self.out(torch.addmm(self.b, x, self.w))


class FlattenUnflatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(2 * D, 2 * D), nn.Unflatten(1, (2, D)), nn.Identity())
        self.out = lin()

    def forward(self, x):  # x: [B, 2, D]
        return self.out(self.net(x))


class DataDependentBranch(nn.Module):  # the branch depends on values; every batch here takes the same one
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = lin(), lin(), lin()

    def forward(self, x):
        h = self.a(x)
        if bool(h.abs().mean() > -1):  # always true, but the tracer cannot know
            return self.b(h)
        return self.c(h)


class InputReturnedToo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = lin()

    def forward(self, x):
        return x, self.a(x), None


class TupleArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, pair):
        x, y = pair
        return self.a(x) * self.b(y)


def _pair(g: torch.Generator) -> tuple[tuple, dict]:
    return ([torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)],), {}


def _bilinear_decoder() -> nn.Module:
    return nn.TransformerDecoderLayer(D, 2, dim_feedforward=32, dropout=0.0, batch_first=True)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dec = _bilinear_decoder()

    def forward(self, x):
        return self.dec(x, x)


CASES += [
    Case("weight_norm_parametrized", WeightNormLinear, x2d(), ("b",)),
    Case("shared_weight_functional", SharedWeightFunctional, x2d(), ("a",)),
    Case("sum_of_heads_generator", SumOfHeads, x2d(), ("heads.0", "heads.1", "heads.2")),
    Case("varargs", VarArgs, lambda g: ((torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)), {}), ("a",)),
    Case("recursive_module", Recursive, x2d(), ("a", "child.a", "child.child.a")),
    Case("autocast_inside", AutocastInside, x2d(), ("a", "b")),
    Case("checkpoint_inside", Checkpointed, x2d(), ("block.0", "block.2", "out")),
    Case("odd_shapes_4d", OddShapes, lambda g: ((torch.randn(1, 3, 2, D, generator=g),), {}), ("a", "b")),
    Case("linear_subclass_lora", WithLinearSubclass, x2d(), ("out", "proj.lora_a", "proj.lora_b")),
    Case("transposed_param_addmm", TransposedParam, x2d(), ("out",)),
    Case("flatten_unflatten", FlattenUnflatten, lambda g: ((torch.randn(4, 2, D, generator=g),), {}), ("net.1", "out")),
    Case("data_dependent_branch", DataDependentBranch, x2d(), ("a", "b"), rewrite_marks=(pytest.mark.xfail(
        raises=RewriteError, strict=True, reason="a branch on a data value: no graph holds it, rewrite() says so"),)),
    Case("input_returned_too", InputReturnedToo, x2d(), ("a",)),
    Case("tuple_arg", TupleArg, _pair, ("a", "b")),
    Case("transformer_decoder_layer", Decoder, x3d(), ("dec.linear1", "dec.linear2", "dec.self_attn.out_proj",
                                                       "dec.multihead_attn.out_proj")),
]


# ---------------------------------------------------------------------- third round: more of torch's layers
class LSTMCellLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(D, D)
        self.out = lin()

    def forward(self, x):  # x: [B, S, D]
        h = c = x.new_zeros(x.shape[0], D)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.out(h)


class BagAndBilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, D, mode="mean")
        self.bilinear = nn.Bilinear(D, D, D)
        self.bn = nn.BatchNorm1d(D)
        self.act = nn.PReLU()
        self.out = lin()

    def forward(self, ids):
        e = self.bag(ids)
        return self.out(self.act(self.bn(self.bilinear(e, e))))


def _bag_ids(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randint(0, 50, (4, 6), generator=g),), {}


class MaskedSDPA(HandSDPA):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4).unbind(0)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, D))


class Baddbmm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = lin(), lin()

    def forward(self, x):
        bias = torch.zeros(x.shape[0], x.shape[1], x.shape[1])
        return torch.baddbmm(bias, self.q(x), self.k(x).transpose(1, 2)).softmax(-1)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(D, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.t(x, x)


CASES += [
    Case("lstmcell_loop", LSTMCellLoop, x3d(), ("out",)),
    Case("embeddingbag_bilinear_bn_prelu", BagAndBilinear, _bag_ids, ("out",)),
    Case("sdpa_bool_mask", MaskedSDPA, x3d(), ("qkv", "o")),
    Case("sdpa_quantized_attention", MaskedSDPA, x3d(), ("qkv", "o"), qconfig=QConfig(quantize_attention=True)),
    Case("baddbmm_softmax", Baddbmm, x3d(), ("q", "k")),
    Case("nn_transformer", Transformer, x3d(), ("t.encoder.layers.0.linear1", "t.decoder.layers.0.linear2")),
]
