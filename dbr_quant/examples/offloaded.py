"""all-MiniLM-L6-v2 with its weights on disk (``accelerate.disk_offload``): prepare, calibrate and convert
without loading the weights into memory; the FP8 weights are written next to accelerate's offload files.

    python -m dbr_quant.examples.offloaded [offload_dir]

Prints the cosine of the sentence embeddings against fp32 and against the same model converted in memory.
"""

from __future__ import annotations

import copy
import sys
import tempfile

import accelerate
import torch

import dbr_quant as dq
from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, EVAL_SENTENCES, encode, load_minilm, sentence_embeddings


def main(offload_dir: str) -> None:
    model, tokenizer = load_minilm()
    batches = [encode(tokenizer, CALIBRATION_SENTENCES[i:i + 4]) for i in range(0, len(CALIBRATION_SENTENCES), 4)]
    held_out = encode(tokenizer, EVAL_SENTENCES)
    fp32 = sentence_embeddings(model, held_out)
    in_memory = dq.convert(dq.calibrate(dq.prepare(model, example_kwargs=batches[0]), batches, progress=False))

    offloaded = accelerate.disk_offload(copy.deepcopy(model), offload_dir, execution_device="cpu")
    prepared = dq.prepare(offloaded, example_kwargs=batches[0], inplace=True)  # no copy of a big model
    dq.calibrate(prepared, batches, progress=False)
    converted = dq.convert(prepared, inplace=True)  # one weight at a time, FP8 back to the offload folder
    emb = sentence_embeddings(converted, held_out)
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b).mean().item()  # noqa: E731
    print(f"weights in {offload_dir}; FP8 embeddings: cosine {cos(emb, fp32):.4f} vs fp32, "
          f"{cos(emb, sentence_embeddings(in_memory, held_out)):.6f} vs converted in memory")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:  # a scratch offload folder, removed afterwards
        with tempfile.TemporaryDirectory(prefix="dbr_quant_offload_") as scratch:
            main(scratch)
