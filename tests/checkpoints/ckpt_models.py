"""Models for the checkpoint tests (imported by conftest.py and the tests): a bf16 Llama (GQA, gated MLP,
``lm_head`` kept high precision), GPT-2
(Conv1D), the real all-MiniLM-L6-v2 and a small non-Hugging-Face model, each prepared, calibrated and
converted."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import dbr_quant as dq

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

VOCAB = 256
# initializer_range 0.01: FP8 noise then moves the logits by ~2 % (the layers still change them by ~35 %);
# with larger weights a 2-layer random Llama amplifies any rounding difference far beyond real models
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=128, initializer_range=0.01, pad_token_id=0)


@dataclass
class Converted:
    model: nn.Module  # the high-precision original
    converted: nn.Module
    eval_inputs: dict


def ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides})).to(torch.bfloat16).eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=128,
                                      initializer_range=0.05, bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()


def convert_hf(model: nn.Module, qconfig: dq.QConfig | None = None) -> Converted:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs={"input_ids": ids(2, 12, 1)}, qconfig=qconfig)
        dq.calibrate(prepared, [{"input_ids": ids(4, 32, s)} for s in (2, 3, 4)], progress=False)
        converted = dq.convert(prepared)
    return Converted(model, converted, {"input_ids": ids(4, 32, 5)})


LM_HEAD_HP = dq.QConfig(overrides=(dq.Override(pattern="^lm_head$", skip=True),))


class TwiceMLP(nn.Module):
    """Not a Hugging Face model; ``proj`` runs at two call sites with different input ranges."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)
        self.register_buffer("offset", torch.linspace(-1, 1, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(3 * torch.relu(self.proj(x))) + self.offset))


def twice(qconfig: dq.QConfig | None = None) -> Converted:
    torch.manual_seed(0)
    model = TwiceMLP().eval()
    g = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, (torch.randn(4, 32, generator=g),), qconfig)
        dq.calibrate(prepared, [torch.randn(16, 32, generator=g) for _ in range(3)], progress=False)
        converted = dq.convert(prepared)
    return Converted(model, converted, {"x": torch.randn(8, 32, generator=g)})


def fp8_linears(model: nn.Module) -> dict[str, nn.Module]:
    from dbr_quant.quantize.weights import fp8_weight_of

    return {n: m for n, m in model.named_modules() if fp8_weight_of(m) is not None}


def input_scale(converted: nn.Module, fqn: str) -> torch.Tensor:
    """The largest static input scale over the call sites of linear ``fqn`` (what the file holds)."""
    record = converted.__dict__["_dbr_record"]
    return torch.stack([st.scale(op, "input") for st in record.states for op in st.seen_ops
                        if op.weight_owner == fqn]).max()
