"""Peak extra memory of a sharded FP8 save and of loading it back, on a random bf16 Llama of a few hundred MB
(CPU): ``dbr_quant.save_pretrained`` against ``safetensors.torch.save_file`` of the converted state_dict, and
``dbr_quant.load_pretrained`` of the saved folder onto a freshly built high-precision model.

    .venv/bin/python benchmarks/checkpoint_memory.py [--hidden 1024 --layers 8 --shard 50MB]
    .venv/bin/python benchmarks/checkpoint_memory.py --foreign   # streamed load vs transformers from_pretrained

Extra memory = the process's peak resident set size during the save (load) minus its size just before (freed
memory returned to the OS first; for the load, the given high-precision model already built), sampled every
millisecond from /proc/self/statm. Each variant runs in a fresh subprocess so earlier allocations do not hide
later ones. For the load, the table also gives what the extra memory is compared with: the FP8 model (the
folder's bytes), one decoder layer in high precision, and the high-precision model.

``--foreign``: a compressed-tensors folder of another tool loaded from the folder alone (no model given), by
``dbr_quant.load_pretrained(folder)`` and by transformers' ``AutoModelForCausalLM.from_pretrained(folder)``. The
baseline is the RSS after importing everything either loader imports (torch, transformers, accelerate,
compressed-tensors, dbr_quant, the architecture's modeling module) and returning freed memory to the OS: the
extra counts the load itself (config, skeleton, every tensor read, the trace, convert), not import cost, and is
compared with the issue's target, the FP8 model (the folder's safetensors bytes) plus its largest shard. A second
figure adds the loaded model's first forward (8 tokens).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples RSS in a thread (file writes and torch ops release the GIL) and keeps the maximum."""

    def __enter__(self) -> PeakRSS:
        self.peak, self.stop = rss(), False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, rss())


def architecture(hidden: int, layers: int):
    """The random bf16 Llama (weights from the seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=int(hidden * 2.75), max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def build(hidden: int, layers: int):
    import torch

    import dbr_quant as dq

    model = architecture(hidden, layers)
    ids = torch.randint(1, 32000, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs={"input_ids": ids}, inplace=True)
        dq.calibrate(prepared, [{"input_ids": ids}], progress=False)
        return dq.convert(prepared, inplace=True)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _free() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_load(hidden: int, layers: int, shard: str) -> dict:
    """Save a converted model, drop it, build the architecture afresh and load the folder onto it."""
    import dbr_quant as dq

    out = tempfile.mkdtemp(prefix="ckpt_load_")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dq.save_pretrained(build(hidden, layers), out, max_shard_size=shard)
    _free()
    fresh = architecture(hidden, layers)
    hp_mb, layer_mb = _bytes(fresh.parameters()) / 1e6, _bytes(fresh.model.layers[0].parameters()) / 1e6
    _free()
    before = rss()
    t = time.perf_counter()
    with PeakRSS() as peak:
        loaded = dq.load_pretrained(out, fresh)
    seconds = time.perf_counter() - t
    files = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")]
    sizes = sorted(os.path.getsize(f) for f in files)
    del loaded
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))
    os.rmdir(out)
    return {"variant": "dbr_quant.load_pretrained", "rss_before_mb": before / 1e6,
            "extra_mb": (peak.peak - before) / 1e6, "seconds": seconds, "files": len(files),
            "largest_file_mb": sizes[-1] / 1e6, "total_mb": sum(sizes) / 1e6,
            "hp_model_mb": hp_mb, "hp_layer_mb": layer_mb}


def foreign_folder(hidden: int, layers: int, shard: str) -> str:
    """A compressed-tensors folder of another tool: a dbr_quant save without dbr_quant.json (per-channel FP8
    weights, static inputs; what transformers and vLLM load), kept across the variants."""
    import dbr_quant as dq

    out = os.path.join(tempfile.gettempdir(), f"ckpt_foreign_{hidden}_{layers}_{shard}")
    if not os.path.isdir(out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dq.save_pretrained(build(hidden, layers), out, max_shard_size=shard)
        os.remove(os.path.join(out, "dbr_quant.json"))
    return out


def _import_everything(folder: str) -> None:
    """What either loader imports, so that the baseline is taken after it (import cost is not load cost):
    transformers, accelerate, compressed-tensors (transformers' quantizer of this folder) and the modeling module
    of the folder's architecture."""
    import accelerate  # noqa: F401
    import compressed_tensors  # noqa: F401
    import transformers

    import dbr_quant  # noqa: F401

    config = transformers.AutoConfig.from_pretrained(folder)
    getattr(transformers, config.architectures[0])  # imports modeling_<arch>.py


def measure_foreign(variant: str, hidden: int, layers: int, shard: str) -> dict:
    """Peak RSS of loading the foreign folder from the folder alone (no model given), above the RSS after every
    import either loader needs; then of the loaded model's first forward (8 tokens)."""
    import torch

    out = foreign_folder(hidden, layers, shard)
    _import_everything(out)
    _free()
    before = rss()
    t = time.perf_counter()
    with PeakRSS() as peak, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "dbr_quant.load_pretrained(folder)":
            import dbr_quant as dq

            loaded = dq.load_pretrained(out)
        else:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(out)
    seconds = time.perf_counter() - t
    with PeakRSS() as forward_peak, torch.no_grad():
        loaded(input_ids=torch.ones(1, 8, dtype=torch.long))
    sizes = sorted(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    del loaded
    return {"variant": variant, "rss_before_mb": before / 1e6, "extra_mb": (peak.peak - before) / 1e6,
            "forward_extra_mb": (forward_peak.peak - before) / 1e6, "seconds": seconds, "files": len(sizes),
            "largest_file_mb": sizes[-1] / 1e6, "total_mb": sum(sizes) / 1e6}


def measure(variant: str, hidden: int, layers: int, shard: str) -> dict:
    import torch

    import dbr_quant as dq

    torch.set_num_threads(1)
    if variant == "dbr_quant.load_pretrained":
        return measure_load(hidden, layers, shard)
    if variant in FOREIGN:
        return measure_foreign(variant, hidden, layers, shard)
    converted = build(hidden, layers)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out = tempfile.mkdtemp(prefix="ckpt_mem_")
    before = rss()
    t = time.perf_counter()
    with PeakRSS() as peak:
        if variant == "dbr_quant.save_pretrained":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dq.save_pretrained(converted, out, max_shard_size=shard)
        else:
            from safetensors.torch import save_file

            save_file(converted.state_dict(), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    seconds = time.perf_counter() - t
    files = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")]
    sizes = sorted(os.path.getsize(f) for f in files)
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))
    os.rmdir(out)
    return {"variant": variant, "rss_before_mb": before / 1e6, "extra_mb": (peak.peak - before) / 1e6,
            "seconds": seconds, "files": len(files), "largest_file_mb": sizes[-1] / 1e6,
            "total_mb": sum(sizes) / 1e6}


FOREIGN = ("dbr_quant.load_pretrained(folder)", "transformers from_pretrained")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard", default="50MB")
    ap.add_argument("--load-only", action="store_true", help="measure load_pretrained only (e.g. with PYTHONPATH "
                    "pointing at another dbr_quant checkout, to compare)")
    ap.add_argument("--foreign", action="store_true", help="a compressed-tensors folder of another tool: "
                    "dbr_quant's streamed load (no model given) against transformers' from_pretrained")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.hidden, args.layers, args.shard)))
        return
    print(f"random bf16 Llama, hidden {args.hidden}, {args.layers} layers, vocab 32000; max_shard_size {args.shard}")
    print(f"{'variant':<42} {'RSS before':>10} {'peak extra':>10} {'files':>5} {'largest':>8} {'total':>8} {'time':>6}")
    variants = ("dbr_quant.save_pretrained", "safetensors save_file(state_dict())", "dbr_quant.load_pretrained")
    if args.foreign:
        foreign_folder(args.hidden, args.layers, args.shard)  # written once, outside the measured processes
        variants = FOREIGN
    for variant in variants[2:] if args.load_only else variants:
        res = subprocess.run([sys.executable, __file__, "--variant", variant, "--hidden", str(args.hidden),
                              "--layers", str(args.layers), "--shard", args.shard],
                             check=True, capture_output=True, text=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{r['variant']:<42} {r['rss_before_mb']:>8.0f}MB {r['extra_mb']:>8.1f}MB {r['files']:>5} "
              f"{r['largest_file_mb']:>6.1f}MB {r['total_mb']:>6.1f}MB {r['seconds']:>5.1f}s")
        if "forward_extra_mb" in r:
            print(f"  peak extra: load {r['extra_mb']:.0f}MB, load + first forward {r['forward_extra_mb']:.0f}MB; "
                  f"target FP8 model (folder) + largest shard = {r['total_mb'] + r['largest_file_mb']:.0f}MB")
        if "hp_model_mb" in r:
            print(f"  load: peak extra {r['extra_mb']:.0f}MB = FP8 model (folder) {r['total_mb']:.0f}MB "
                  f"+ {r['extra_mb'] - r['total_mb']:.0f}MB; one high-precision decoder layer "
                  f"{r['hp_layer_mb']:.0f}MB, high-precision model {r['hp_model_mb']:.0f}MB (given, not counted)")


if __name__ == "__main__":
    main()
