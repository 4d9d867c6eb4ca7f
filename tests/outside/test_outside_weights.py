"""Third-party code that reads or changes a converted model's weights and parameters: Hugging Face's
``PreTrainedModel`` helpers (memory footprint, parameter counts, token-embedding resizing, weight init), torch's
parameter utilities (``parameters_to_vector``, ``clip_grad_norm_``, an optimizer step over the trainable rest,
prune, parametrize), dtype casts, copies and pickles. Each result is compared with a reference: the stored
tensors themselves, the converted model before the operation, or the fp32 model within the FP8 bound."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import compute_module_sizes as accelerate_sizes
from outside_pipeline import rel_l2
from torch import nn
from torch.nn.utils import parametrize, prune
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.integrations.accelerate import compute_module_sizes
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant.integrations.accelerate import fp8_special_dtypes
from dbr_quant.quantize.weights import FP8Weight

hf_logging.set_verbosity_error()

VOCAB, HIDDEN = 256, 64
LOGITS_REL_L2 = 0.15  # measured 0.09 (Llama), FP8 through two random-weight layers and the lm_head


def _llama(tie: bool) -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=0, tie_word_embeddings=tie,
        initializer_range=0.05))


def _gpt2(tie: bool) -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_inner=128, n_positions=128, initializer_range=0.05,
        tie_word_embeddings=tie, pad_token_id=0))


def _bert(tie: bool) -> nn.Module:
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=128, initializer_range=0.1))


BUILDS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


def _ids(seed: int, shape: tuple[int, int] = (2, 12)) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))}


def _pair(name: str, tie: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = BUILDS[name](tie).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs=_ids(1))
        dq.calibrate(prepared, [_ids(seed) for seed in range(2, 5)], progress=False)
        return model, dq.convert(prepared)


def _out(model: nn.Module, batch: dict | None = None) -> torch.Tensor:
    with torch.no_grad():
        out = model(**(batch or _ids(9)))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _fp8(model: nn.Module) -> dict[str, FP8Weight]:
    return {n: p for n, p in model.named_parameters() if type(p) is FP8Weight}


def _stored_bytes(model: nn.Module, buffers: bool) -> int:
    """What the model's tensors occupy, read from the tensors themselves (each parameter once, as
    ``parameters()`` yields it: a tie shares one)."""
    total = 0
    for p in model.parameters():
        inner = (p.qdata, p.scale) if type(p) is FP8Weight else (p,)
        total += sum(t.numel() * t.element_size() for t in inner)
    if buffers:
        total += sum(b.numel() * b.element_size() for b in model.buffers())
    return total


# ---------------------------------------------------------------------- sizes and counts
@pytest.mark.parametrize(("name", "tie"), [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True),
                                           ("bert", False)])  # BertModel has no lm_head to tie
@pytest.mark.parametrize("buffers", [True, False], ids=["buffers", "params"])
def test_memory_footprint_is_the_stored_bytes(name, tie, buffers):
    """``get_memory_footprint`` summed ``nelement() * element_size()`` with the 4 bytes of the fp32 an FP8 weight
    reports: the converted Llama came out larger than the fp32 one (362128 vs 361792 bytes). It is now the
    bytes its tensors hold (FP8 data + scales), below the fp32 model's by the FP8 saving."""
    model, converted = _pair(name, tie)
    got = converted.get_memory_footprint(return_buffers=buffers)
    assert isinstance(got, int) and got == _stored_bytes(converted, buffers)
    fp8 = _fp8(converted)
    assert fp8
    saved = sum(3 * w.numel() - w.scale.numel() * w.scale.element_size() for w in fp8.values())
    assert model.get_memory_footprint(return_buffers=False) - converted.get_memory_footprint(return_buffers=False) \
        == saved
    # transformers' own device-map planning sizes parameters the same way
    sizes, _ = compute_module_sizes(converted)
    assert sizes[""] == _stored_bytes(converted, True)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_parameter_counts_and_model_dtype_are_the_fp32_models(name):
    """Counts are of logical elements (what a user compares between models), dtype and device the reported ones."""
    model, converted = _pair(name, tie=False)
    assert converted.num_parameters() == model.num_parameters()
    assert converted.num_parameters(exclude_embeddings=True) == model.num_parameters(exclude_embeddings=True)
    assert converted.num_parameters(only_trainable=True) == model.num_parameters(only_trainable=True) - sum(
        w.numel() for w in _fp8(converted).values())
    assert (converted.dtype, converted.device) == (model.dtype, model.device)
    vector = nn.utils.parameters_to_vector(converted.parameters())
    want = torch.cat([(p.dequantize() if type(p) is FP8Weight else p).reshape(-1) for p in converted.parameters()])
    assert torch.equal(vector, want) and vector.numel() == model.num_parameters()
    assert len(list(converted.named_parameters(remove_duplicate=False))) == len(
        list(model.named_parameters(remove_duplicate=False)))


# ---------------------------------------------------------------------- embeddings
def test_resize_token_embeddings_with_a_converted_untied_lm_head():
    """``resize_token_embeddings`` copies the old lm_head's rows into a new nn.Linear
    (``new.weight.data[:n] = old.weight.data[:n]``): the copy of an FP8 weight into a plain tensor raised
    AttributeError ('Tensor' object has no attribute 'block'). The new head gets the dequantized rows; it is a
    module prepare() never traced, so it runs in high precision with a warning, and the old tokens' logits stay
    those of the converted model within FP8 activation error."""
    _, converted = _pair("llama", tie=False)
    reference = _out(converted)
    old = converted.lm_head.weight.dequantize()
    converted.resize_token_embeddings(VOCAB + 44)
    assert torch.equal(converted.lm_head.weight[:VOCAB], old)
    with pytest.warns(UserWarning, match="never saw"):
        got = _out(converted)
    assert got.shape[-1] == VOCAB + 44 and rel_l2(got[..., :VOCAB], reference) < 0.05  # measured 0.028


def test_resize_token_embeddings_with_a_tied_lm_head_keeps_the_tie():
    _, converted = _pair("llama", tie=True)
    reference = _out(converted)
    assert type(converted.get_output_embeddings().weight) is not FP8Weight  # a tied head stays high precision
    converted.resize_token_embeddings(VOCAB + 44)
    converted.tie_weights()
    assert converted.lm_head.weight is converted.get_input_embeddings().weight
    assert torch.equal(_out(converted)[..., :VOCAB], reference)


# ---------------------------------------------------------------------- training the rest
def test_fine_tuning_norms_beside_frozen_fp8_weights():
    """A fine-tuning loop over the trainable rest: AdamW on the norms, ``clip_grad_norm_`` over every parameter
    (FP8 weights have no gradient and are skipped, as any frozen parameter). The FP8 bytes do not move, the
    norms do, and the step lowers the loss."""
    _, converted = _pair("llama", tie=False)
    fp8_before = {n: (w.qdata.clone(), w.scale.clone()) for n, w in _fp8(converted).items()}
    for name, p in converted.named_parameters():
        if type(p) is not FP8Weight:
            p.requires_grad_("norm" in name)
    norms = {n: p.detach().clone() for n, p in converted.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in converted.parameters() if p.requires_grad], lr=1e-2)
    batch = _ids(9)
    losses = []
    for _ in range(2):
        loss = converted(**batch, labels=batch["input_ids"]).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        total = nn.utils.clip_grad_norm_(converted.parameters(), 1.0)
        want = torch.stack([p.grad.norm() for p in converted.parameters() if p.grad is not None]).norm()
        assert torch.isfinite(total) and torch.allclose(total, want)
        optimizer.step()
    assert losses[1] < losses[0]
    assert all(not torch.equal(p, norms[n]) for n, p in converted.named_parameters() if n in norms)
    for n, w in _fp8(converted).items():
        assert torch.equal(w.qdata.view(torch.uint8), fp8_before[n][0].view(torch.uint8))
        assert torch.equal(w.scale, fp8_before[n][1])


# ---------------------------------------------------------------------- dtype casts
@pytest.mark.parametrize("cast", ["half", "bfloat16", "half_then_float"])
def test_dtype_casts_keep_fp8_bytes(cast):
    """``model.half()`` / ``.to(torch.bfloat16)`` / ``.half().float()``: the FP8 bytes and scales stay as convert
    made them (only the reported compute dtype changes), the footprint keeps counting them, and the output
    stays within the FP8 bound of the fp32 model cast the same way."""
    model, converted = _pair("llama", tie=False)
    before = {n: (w.qdata.clone(), w.scale.clone()) for n, w in _fp8(converted).items()}
    fp8_bytes = sum(w.nbytes for w in _fp8(converted).values())
    apply = {"half": lambda m: m.half(), "bfloat16": lambda m: m.to(torch.bfloat16),
             "half_then_float": lambda m: m.half().float()}[cast]
    apply(converted)
    apply(model)
    after = _fp8(converted)
    assert after.keys() == before.keys()
    for n, w in after.items():
        assert w.dtype == converted.dtype and w.qdata.dtype == torch.float8_e4m3fn
        assert torch.equal(w.qdata.view(torch.uint8), before[n][0].view(torch.uint8))
        assert torch.equal(w.scale, before[n][1])
    assert sum(w.nbytes for w in after.values()) == fp8_bytes
    linears = [row for row in dq.report(converted) if row["kind"] == "linear"]
    assert {row["weight"] for row in linears if row["fp8"]} == set(after)
    assert converted.get_memory_footprint() == _stored_bytes(converted, True)
    got = _out(converted)
    assert got.dtype == _out(model).dtype == converted.dtype
    assert rel_l2(got.float(), _out(model).float()) < LOGITS_REL_L2


def test_hf_init_weights_over_a_converted_model_keeps_fp8():
    """HF's ``_init_weights`` applied to a converted model (``model.apply(model._init_weights)``) draws new
    values into each linear weight in place: they are quantized into the FP8 weight (never a silent fp32
    weight), on the grid of the weight's own scale rule."""
    _, converted = _pair("llama", tie=False)
    before = {n: w.dequantize() for n, w in _fp8(converted).items()}
    torch.manual_seed(3)
    converted.apply(converted._init_weights)
    after = _fp8(converted)
    assert after.keys() == before.keys()
    for n, w in after.items():
        assert not torch.equal(w.dequantize(), before[n])
        assert torch.equal(w.dequantize(), (w.qdata.float() * w.elementwise_scale()))


# ---------------------------------------------------------------------- torch.nn.utils that move the weight
class _Identity(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w


@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_prune_or_parametrize_after_convert_is_refused_naming_the_module(how):
    """``prune.l1_unstructured`` / ``register_parametrization`` on a converted linear move its FP8 weight out of
    ``weight``; the layer then ran silently in high precision on the dequantized weight (with a warning that
    spoke of control flow). It raises naming the module and what to do; undoing a parametrization restores the
    converted model's output."""
    _, converted = _pair("llama", tie=False)
    reference = _out(converted)
    up = converted.model.layers[0].mlp.up_proj
    if how == "prune":
        prune.l1_unstructured(up, "weight", amount=0.3)
    else:
        parametrize.register_parametrization(up, "weight", _Identity())
    with pytest.raises(RuntimeError, match=r"converted linear 'model\.layers\.0\.mlp\.up_proj'.*before prepare"):
        _out(converted)
    if how == "parametrize":
        parametrize.remove_parametrizations(up, "weight", leave_parametrized=False)
        assert type(up.weight) is FP8Weight and torch.equal(_out(converted), reference)


# ---------------------------------------------------------------------- copies and pickles
def test_deepcopy_and_pickle_give_the_same_outputs():
    _, converted = _pair("gpt2", tie=False)
    reference = _out(converted)
    assert torch.equal(_out(copy.deepcopy(converted)), reference)
    buf = io.BytesIO()
    torch.save(converted, buf)
    buf.seek(0)
    assert torch.equal(_out(torch.load(buf, weights_only=False)), reference)


def test_state_dict_loads_with_weights_only():
    """``torch.load``'s default ``weights_only=True`` reads a converted state_dict (plain float8 + fp32 tensors)
    into another converted model of the same architecture, which then gives the same outputs."""
    _, converted = _pair("llama", tie=False)
    torch.manual_seed(5)
    _, other = _pair("llama", tie=False)
    for w in _fp8(other).values():
        w.qdata.zero_()
    buf = io.BytesIO()
    torch.save(converted.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(_out(other), _out(converted))


# ---------------------------------------------------------------------- accelerate
def test_accelerate_planning_counts_fp8_bytes():
    """accelerate sizes a tensor by its reported dtype: a converted model was planned at 4 bytes per FP8 weight
    element (427688 bytes for the Llama, more than the fp32 model's 427328). ``fp8_special_dtypes`` gives it the
    storage dtype: the plan is the stored bytes less the scales, and a budget that fits the FP8 model but not
    its fp32 size keeps every module on the device."""
    model, converted = _pair("llama", tie=False)
    special = fp8_special_dtypes(converted)
    fp8 = _fp8(converted)
    assert special.keys() == fp8.keys()
    sizes = accelerate_sizes(converted, special_dtypes=special)
    scales = sum(w.scale.numel() * w.scale.element_size() for w in fp8.values())
    assert sizes[""] == _stored_bytes(converted, True) - scales
    budget = (sizes[""] + accelerate_sizes(converted)[""]) // 2  # between the FP8 plan and the fp32-sized one
    assert set(infer_auto_device_map(converted, max_memory={"cpu": budget}, special_dtypes=special).values()) \
        == {"cpu"}
    assert "disk" in infer_auto_device_map(converted, max_memory={"cpu": budget}).values()
    reference = _out(converted)
    dispatched = dispatch_model(converted, device_map=infer_auto_device_map(
        converted, max_memory={"cpu": budget}, special_dtypes=special))
    assert torch.equal(_out(dispatched), reference)


def test_init_empty_weights_registers_an_fp8_weight_on_meta():
    """Under accelerate's ``init_empty_weights`` a parameter registered on a module is rebuilt on ``meta`` as
    ``type(param)(param.to('meta'), **param.__dict__)``: an FP8 weight raised TypeError ('multiple values for
    argument qdata'). It becomes a meta FP8 weight of the same shape, dtype and layout."""
    _, converted = _pair("gpt2", tie=False)
    source = converted.transformer.h[0].mlp.c_fc.weight
    with init_empty_weights():
        target = nn.Linear(1, 1)
        target.register_parameter("weight", source)
    w = target.weight
    assert type(w) is FP8Weight and isinstance(w, nn.Parameter) and not w.requires_grad
    assert (w.device.type, w.qdata.device.type, w.scale.device.type) == ("meta", "meta", "meta")
    assert (w.shape, w.dtype, w.transposed, w.block, w.qdata.dtype, w.scale.shape) == (
        source.shape, source.dtype, source.transposed, source.block, source.qdata.dtype, source.scale.shape)
    assert source.device.type == "cpu"


# ---------------------------------------------------------------------- the real MiniLM
def test_minilm_footprint_and_counts(minilm):
    """The real all-MiniLM-L6-v2: the footprint is its stored bytes and shows the saving on its linears (its
    embeddings, half the model, stay fp32), the parameter count is the fp32 model's."""
    model, converted, batch = minilm
    fp8 = _fp8(converted)
    assert len(fp8) == 6 * 6 + 1  # q, k, v, attention output, intermediate, output per layer; the pooler
    assert converted.get_memory_footprint() == _stored_bytes(converted, True)
    saved = sum(3 * w.numel() - w.scale.numel() * w.scale.element_size() for w in fp8.values())
    assert model.get_memory_footprint(return_buffers=False) - converted.get_memory_footprint(return_buffers=False) \
        == saved
    assert converted.num_parameters() == model.num_parameters()
    assert torch.equal(copy.deepcopy(converted)(**batch).last_hidden_state, converted(**batch).last_hidden_state)
