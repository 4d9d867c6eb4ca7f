"""Peak memory (RSS) of convert() on a Llama of a few hundred MB: in memory, copied, CPU- and disk-offloaded.

    .venv/bin/python benchmarks/convert_memory.py            (all variants, one fresh process each)
    .venv/bin/python benchmarks/convert_memory.py --variant inplace

Every variant runs twice: with glibc's default malloc (RSS then includes freed memory malloc keeps for
reuse) and with ``MALLOC_MMAP_THRESHOLD_=1048576`` (blocks over 1 MiB are mapped and unmapped on their own,
so RSS follows live memory).

Each variant builds the model (fp32, random weights), prepares it in place, calibrates two batches, then
resets the kernel's peak-RSS counter (``/proc/self/clear_refs``, Linux) and runs convert. Reported (MiB):
``base`` the process before the model exists (Python, torch, transformers), ``before`` RSS just before
convert (freed heap handed back to the OS with ``malloc_trim`` first, so it is live memory), ``peak`` the
highest RSS during convert, ``after`` RSS after it (trimmed too). ``peak - before`` is convert's own
overhead, to compare with the largest layer; ``bound`` = fp32 model + largest layer, to compare with
``peak - base`` (which also holds the first forward's runtime allocations, a few tens of MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

VARIANTS = {
    "inplace": "in memory, convert(inplace=True)",
    "copy": "in memory, convert(inplace=False)",
    "cpu_offload": "accelerate.cpu_offload, convert(inplace=True)",
    "disk_offload": "accelerate.disk_offload, convert(inplace=True)",
}
CONFIG = dict(vocab_size=1024, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=256, use_cache=False)
MIB = 2**20


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS shows what is live, not what malloc kept."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def measure(variant: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import dbr_quant as dq

    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # CPU seconds without OpenMP spin-waits on a shared machine
    _trim()
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    fp32 = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    largest = max(m.weight.numel() * m.weight.element_size() for m in model.modules()
                  if isinstance(m, torch.nn.Linear)) / MIB
    tmp = tempfile.mkdtemp()
    if variant == "cpu_offload":
        import accelerate
        model = accelerate.cpu_offload(model, execution_device="cpu")
    elif variant == "disk_offload":
        import accelerate
        model = accelerate.disk_offload(model, tmp, execution_device="cpu")
    example = {"input_ids": torch.randint(0, CONFIG["vocab_size"], (1, 32))}
    prepared = dq.prepare(model, example_kwargs=example, inplace=True)
    dq.calibrate(prepared, [{"input_ids": torch.randint(0, CONFIG["vocab_size"], (2, 64))} for _ in range(2)],
                 progress=False)
    del model
    _trim()
    before = _status("VmRSS")
    _reset_peak()
    start, cpu = time.perf_counter(), time.process_time()
    converted = dq.convert(prepared, inplace=variant != "copy")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _status("VmHWM")
    _trim()
    after = _status("VmRSS")
    logits = converted(**example).logits  # it works
    assert torch.isfinite(logits).all()
    shutil.rmtree(tmp, ignore_errors=True)  # the disk-offload folder
    return {"variant": variant, "fp32": fp32, "largest": largest, "base": base, "before": before, "peak": peak,
            "after": after, "seconds": seconds, "cpu_seconds": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return
    rows = []
    for malloc in ("default", "mmap>1MiB"):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if malloc != "default":
            env["MALLOC_MMAP_THRESHOLD_"] = str(MIB)
        for variant in VARIANTS:  # a fresh process each: peaks and allocator state do not carry over
            out = subprocess.run([sys.executable, __file__, "--variant", variant], check=True, capture_output=True,
                                 text=True, env=env)
            rows.append({**json.loads(out.stdout.strip().splitlines()[-1]), "malloc": malloc})
    r0 = rows[0]
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}: fp32 weights "
          f"{r0['fp32']:.0f} MiB, largest linear {r0['largest']:.1f} MiB (fp32). RSS in MiB; base = before the model.")
    print(f"{'variant':<46} {'malloc':<10} {'base':>6} {'before':>7} {'peak':>7} {'after':>7} {'peak-base':>10} "
          f"{'peak-before':>12} {'bound':>7} {'cpu s':>6}")
    for r in rows:
        bound = r["fp32"] + r["largest"]
        print(f"{VARIANTS[r['variant']]:<46} {r['malloc']:<10} {r['base']:>6.0f} {r['before']:>7.0f} "
              f"{r['peak']:>7.0f} {r['after']:>7.0f} {r['peak'] - r['base']:>10.0f} "
              f"{r['peak'] - r['before']:>12.1f} {bound:>7.0f} {r['cpu_seconds']:>6.1f}")


if __name__ == "__main__":
    main()
