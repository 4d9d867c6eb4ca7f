"""Data-parallel calibration of all-MiniLM-L6-v2 on CPU: every process calibrates its share of the batches.

    torchrun --nproc-per-node 2 -m dbr_quant.examples.distributed_calibration

``convert`` merges the observers across the processes first, so every rank ends with the scales that one
process calibrating all batches gets; rank 0 checks that and prints the largest difference (0 for the
default running-max observer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dbr_quant as dq
from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, encode, load_minilm


def _scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "scale_" in k}


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; use "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokenizer = load_minilm()
    batches = [encode(tokenizer, CALIBRATION_SENTENCES[i:i + 4]) for i in range(0, len(CALIBRATION_SENTENCES), 4)]
    prepared = dq.prepare(model, example_kwargs=batches[0])
    dq.calibrate(prepared, batches[rank::world], progress=False)  # this rank's share
    converted = dq.convert(prepared)  # collective: every rank must call it
    if rank == 0:
        alone = dq.prepare(model, example_kwargs=batches[0])
        single = _scales(dq.convert(dq.calibrate(alone, batches, progress=False), sync=False))
        merged = _scales(converted)
        worst = max((merged[k] - single[k]).abs().max().item() for k in single)
        print(f"{world} ranks, {len(batches)} batches: {len(merged)} activation scales, largest difference "
              f"to one process calibrating all batches: {worst}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
