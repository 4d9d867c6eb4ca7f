"""torch's own attention layers (nn.MultiheadAttention, nn.TransformerEncoder(Layer), nn.TransformerDecoderLayer,
nn.Transformer) and functional linears on parameters (a LoRA written as matmuls) convert fully to FP8.

Each model goes prepare → calibrate → convert and is compared with the fp32 model: close (a relative error
bound), not equal (FP8 ran: the weights are stored FP8 and the FP8 GEMM launched once per linear), and torch's
fused fast path (``torch._transformer_encoder_layer_fwd`` / ``torch._native_multi_head_attention``, which
skips the linears inside) is taken neither in calibration nor in the converted forward.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight

D, HEADS, FF = 32, 4, 64


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prepare's "stays high precision" note on the (unquantized) attention
        yield


@contextlib.contextmanager
def no_fast_path():
    """Fail if torch takes its fused fast path inside the block (it would skip the linears dbr_quant runs)."""
    saved = torch._transformer_encoder_layer_fwd, torch._native_multi_head_attention

    def refuse(*args, **kwargs):
        raise AssertionError("torch took its fused fast path inside a dbr_quant forward")

    torch._transformer_encoder_layer_fwd = torch._native_multi_head_attention = refuse
    try:
        yield
    finally:
        torch._transformer_encoder_layer_fwd, torch._native_multi_head_attention = saved


def _call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def convert_and_compare(model: nn.Module, batches: list, grad_mode=torch.no_grad, bound: float = 0.06):
    """prepare → calibrate → convert under ``grad_mode``; returns (converted, fp8 GEMM launches of one forward).
    Asserts the converted output is within ``bound`` (relative) of fp32 and not equal to it."""
    model.eval()
    first = batches[0]
    args, kwargs = ((), first) if isinstance(first, dict) else (first, {})
    prepared = dq.prepare(model, args, example_kwargs=kwargs)
    with grad_mode(), no_fast_path():
        dq.calibrate(prepared, batches, progress=False)
        converted = dq.convert(prepared)
        with dq.kernels.count_launches() as launches:
            out = _first(_call(converted, first))
    with torch.no_grad():
        ref = _first(_call(model, first))
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < bound, rel
    return converted, launches["fp8_linear"] + 2 * launches["fp8_mlp"]


def assert_fp8(converted: nn.Module, names: list[str]) -> None:
    params = dict(converted.named_parameters())
    for name in names:
        w = params[name]
        assert type(w) is FP8Weight and w.qdata.dtype == torch.float8_e4m3fn, name
    rows = dq.report(converted)
    for name in names:  # the parameter's row, or one per row slice ("in_proj_weight[0:32]")
        label = name.removesuffix(".weight")
        mine = [r for r in rows if r["fqn"] == label or r["fqn"].startswith(label + "[")]
        assert mine and all(r["kind"] == "linear" and r["fp8"] for r in mine), (name, mine)


def layer_params(prefix: str, cross: bool = False) -> list[str]:
    names = [f"{prefix}self_attn.in_proj_weight", f"{prefix}self_attn.out_proj.weight", f"{prefix}linear1.weight",
             f"{prefix}linear2.weight"]
    return names + ([f"{prefix}multihead_attn.in_proj_weight", f"{prefix}multihead_attn.out_proj.weight"]
                    if cross else [])


class TinyViT(nn.Module):
    """Patches → linear embedding, class token, positions, nn.TransformerEncoder (pre-norm, batch first), head."""

    def __init__(self, layers: int = 2, patch: int = 4, image: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, D) * 0.02)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        x = self.embed(patches)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def test_vit_on_transformer_encoder_converts_fully():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16),) for _ in range(3)]
    converted, gemms = convert_and_compare(TinyViT(), batches, bound=0.1)  # 0.057 with the attention skipped
    assert_fp8(converted, ["embed.weight", "head.weight", *layer_params("encoder.layers.0."),
                           *layer_params("encoder.layers.1.")])
    assert gemms >= 2 + 2 * 4  # every linear ran its FP8 GEMM: embed, head, 4 per layer


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_encoder_layer_with_masks(batch_first, norm_first, grad_mode):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    batches = []
    for _ in range(3):
        src = torch.randn(3, 6, D) if batch_first else torch.randn(6, 3, D)
        padding = torch.zeros(3, 6, dtype=torch.bool)
        padding[1, 4:] = True
        causal = nn.Transformer.generate_square_subsequent_mask(6)
        batches.append({"src": src, "src_mask": causal, "src_key_padding_mask": padding, "is_causal": True})
    converted, gemms = convert_and_compare(layer, batches, grad_mode)
    assert_fp8(converted, layer_params(""))
    assert gemms >= 4


def test_multihead_attention_alone_self_cross_and_separate_kv():
    """Self-attention reads in_proj_weight whole; query ≠ key = value splits it into [E] and [2E] rows; query,
    key, value all different into three [E] chunks: each slice is a linear on the FP8 weight's rows."""
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
    q, kv, v = torch.randn(2, 5, D), torch.randn(2, 7, D), torch.randn(2, 7, D)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, 5:] = True
    for batch, slices in [((q, q, q), ["in_proj_weight"]),
                          ((q, kv, kv), ["in_proj_weight[0:32]", "in_proj_weight[32:96]"]),
                          ((q, kv, v), ["in_proj_weight[0:32]", "in_proj_weight[32:64]", "in_proj_weight[64:96]"])]:
        batches = [{"query": batch[0], "key": batch[1], "value": batch[2],
                    "key_padding_mask": padding if batch[1] is not batch[0] else None}] * 2
        converted, gemms = convert_and_compare(mha, batches, bound=0.08)
        assert_fp8(converted, ["out_proj.weight"])
        assert type(converted.in_proj_weight) is FP8Weight
        rows = {r["fqn"]: r for r in dq.report(converted)}
        assert all(rows[s]["fp8"] and rows[s]["kind"] == "linear" for s in slices), rows
        assert gemms == len(slices) + 1


def test_multihead_attention_with_separate_projection_weights():
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(D, HEADS, kdim=16, vdim=24, batch_first=True)
    batches = [(torch.randn(2, 5, D), torch.randn(2, 7, 16), torch.randn(2, 7, 24)) for _ in range(2)]
    converted, gemms = convert_and_compare(mha, batches, bound=0.08)
    assert_fp8(converted, ["q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"])
    assert gemms == 4


def test_nn_transformer_encoder_and_decoder():
    torch.manual_seed(4)
    model = nn.Transformer(D, HEADS, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
                           batch_first=True)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    batches = [{"src": torch.randn(2, 7, D), "tgt": torch.randn(2, 5, D), "tgt_mask": tgt_mask, "tgt_is_causal": True}
               for _ in range(3)]
    converted, gemms = convert_and_compare(model, batches)
    names = [n for i in range(2) for n in layer_params(f"encoder.layers.{i}.")]
    names += [n for i in range(2) for n in layer_params(f"decoder.layers.{i}.", cross=True)]
    assert_fp8(converted, names)
    rows = {r["fqn"]: r for r in dq.report(converted)}
    assert rows["decoder.layers.0.multihead_attn.in_proj_weight[32:96]"]["fp8"]  # cross-attention's key/value rows
    assert gemms >= 2 * 4 + 2 * 7  # encoder: 4 linears per layer; decoder: 4 + cross (q, kv, out)


def test_converted_attention_state_dict_round_trip():
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, D)
    prepared = dq.prepare(layer, (x,))
    dq.calibrate(prepared, [x], progress=False)
    converted = dq.convert(prepared)
    sd = converted.state_dict()
    assert sd["self_attn.in_proj_weight"].dtype == torch.float8_e4m3fn and "self_attn.in_proj_weight_scale" in sd
    other = dq.convert(prepared)
    nn.init.zeros_(other.self_attn.in_proj_weight.qdata.view(torch.uint8))
    other.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(other(x), converted(x))


class Lora(nn.Module):
    """A base linear plus a LoRA written as matmuls, and a projection stored [in, out] used with torch.matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.A = nn.Parameter(torch.randn(8, D) / 6)
        self.B = nn.Parameter(torch.randn(D, 8) / 3)
        self.w = nn.Parameter(torch.randn(D, 16) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x) + x @ self.A.t() @ self.B.t()
        return torch.matmul(h, self.w)


def test_activation_times_parameter_matmul_is_a_linear():
    torch.manual_seed(6)
    batches = [(torch.randn(4, 6, D),) for _ in range(3)]
    converted, gemms = convert_and_compare(Lora(), batches, bound=0.08)
    assert_fp8(converted, ["base.weight", "A", "B", "w"])
    assert not converted.A.transposed and converted.w.transposed and converted.w.shape == (D, 16)
    assert gemms == 4


def test_parameter_matmul_against_torch_cast():
    """``x @ A.t()`` after convert is x quantized with its calibrated scale times A quantized per output channel,
    as torch's own cast computes them."""
    class Proj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A = nn.Parameter(torch.randn(24, D))

        def forward(self, x):
            return x @ self.A.t()

    torch.manual_seed(7)
    model, x = Proj().eval(), torch.randn(5, D)
    prepared = dq.prepare(model, (x,))
    dq.calibrate(prepared, [x], progress=False)
    converted = dq.convert(prepared)
    st = dq.quant_state(converted)
    s_x = st.scale(st.seen_ops[0], "input")
    fp8, amax = torch.float8_e4m3fn, 448.0
    s_w = model.A.detach().abs().amax(dim=1, keepdim=True) / amax
    x_deq = (x / s_x).clamp(-amax, amax).to(fp8).float() * s_x
    w_deq = (model.A.detach() / s_w).to(fp8).float() * s_w
    with torch.no_grad():
        torch.testing.assert_close(converted(x), x_deq @ w_deq.t(), rtol=1e-5, atol=1e-5)


def test_parameter_read_elsewhere_keeps_its_high_precision_values():
    """An embedding tied to an output projection: the lookup needs the fp32 values, so the parameter stays a
    parameter and the linear quantizes it per call (its row says so)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Parameter(torch.randn(50, D))

        def forward(self, ids):
            h = F.embedding(ids, self.emb)
            return h, F.linear(h, self.emb)

    torch.manual_seed(8)
    model, ids = Tied().eval(), torch.randint(0, 50, (2, 6))
    prepared = dq.prepare(model, (ids,))
    dq.calibrate(prepared, [ids], progress=False)
    converted = dq.convert(prepared)
    assert type(converted.emb) is nn.Parameter and converted.emb.dtype == torch.float32
    (row,) = dq.report(converted)
    assert row["fp8"] and "every call" in row["reason"] and "embedding" in row["reason"]
    with torch.no_grad():
        h, logits = converted(ids)
        assert torch.equal(h, model(ids)[0])


@pytest.mark.slow  # torch.compile: about 30 s on a busy 2-core machine
def test_rewrite_and_compile_an_encoder_layer():
    torch.manual_seed(9)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True).eval()
    x = torch.randn(2, 5, D)
    prepared = dq.prepare(layer, (x,))
    dq.calibrate(prepared, [x, torch.randn(2, 5, D)], progress=False)
    converted = dq.convert(prepared)
    gm = dq.fx_rewriter.rewrite(converted)
    with torch.no_grad():
        eager = converted(x)
        assert torch.equal(gm(x), eager)
        compiled = torch.compile(gm, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=1e-4, atol=1e-4)


def test_save_pretrained_names_the_functional_fp8_weights_it_cannot_write(tmp_path):
    """compressed-tensors describes FP8 Linear modules only: an FP8 in_proj_weight is refused before anything is
    written, with the parameter named (a loader would otherwise read FP8 bytes as a high-precision weight)."""
    torch.manual_seed(10)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, D)
    prepared = dq.prepare(layer, (x,))
    dq.calibrate(prepared, [x], progress=False)
    with pytest.raises(dq.CheckpointError, match=r"self_attn\.in_proj_weight"):
        dq.save_pretrained(dq.convert(prepared), tmp_path)
    assert not any(tmp_path.iterdir())


def test_override_skips_a_parameter_linear_by_its_parameter_name():
    """An Override pattern names a functional linear by its parameter: skipping the in-projection keeps
    in_proj_weight a high-precision parameter while the rest of the layer converts."""
    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, D)
    qconfig = dq.QConfig(overrides=(dq.Override(pattern=r".*in_proj_weight", skip=True),))
    prepared = dq.prepare(layer, (x,), qconfig)
    dq.calibrate(prepared, [x], progress=False)
    converted = dq.convert(prepared)
    assert type(converted.self_attn.in_proj_weight) is nn.Parameter
    assert_fp8(converted, ["self_attn.out_proj.weight", "linear1.weight", "linear2.weight"])
    row = next(r for r in dq.report(converted) if r["fqn"] == "self_attn.in_proj_weight")
    assert not row["fp8"] and "override" in row["reason"]
