"""Where the transformers-loaded MiniLM checkpoint and dbr_quant's converted model part ways, and why.

    .venv/bin/python benchmarks/checkpoint_agreement.py

Converts all-MiniLM-L6-v2 as the checkpoint tests do, writes it with ``save_pretrained``, loads it with
transformers + compressed-tensors (CPU), and prints, on the held-out sentences (one intra-op thread):

1. min / mean embedding cosine against dbr_quant's bf16 and fp32 CPU GEMM paths and its exact kernels
   (fp32 GEMMs with the scales on the accumulator, what its GPU kernels compute);
2. whether the fp32 CPU GEMM path (operands dequantized first, then an fp32 ``F.linear`` with the bias:
   the loader's arithmetic) gives the loaded model's embeddings bit for bit;
3. per module, dbr_quant's output against the loaded module run on the very inputs dbr_quant's module
   got (the local difference, upstream differences removed), on each CPU GEMM path;
4. per linear, how many FP8 codes of its input (with the file's input scale) differ between the two
   models with dbr_quant's exact kernels: the cascade of rounding flips layer by layer;
5. the noise floor: the loaded model against itself with one rounding changed per linear (``y - b + b``).
"""

from __future__ import annotations

import tempfile
import warnings

import torch

import dbr_quant as dq
from dbr_quant.examples import minilm
from dbr_quant.kernels import use_backend, use_cpu_gemm


def _cos(a: torch.Tensor, b: torch.Tensor) -> str:
    c = (a * b).sum(-1)
    return f"min {c.min():.5f} mean {c.mean():.5f}"


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_clone(t) for t in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def local_differences(converted, loaded, batch, names: list[str]) -> dict[str, float]:
    """Relative difference of each module's output from the loaded module run on dbr_quant's own inputs
    (real tokens only)."""
    seen = {}
    hooks = [converted.get_submodule(n).register_forward_hook(
        lambda m, a, k, o, n=n: seen.__setitem__(n, (_clone(a), _clone(k), _clone(_first(o)))), with_kwargs=True)
        for n in names]
    with torch.no_grad():
        converted(**batch)
    for h in hooks:
        h.remove()
    mask, out = batch["attention_mask"].bool(), {}
    for n, (args, kwargs, ours) in seen.items():
        with torch.no_grad():
            theirs = _first(loaded.get_submodule(n)(*args, **kwargs))
        if theirs.dim() == 3:
            theirs, ours = theirs[mask], ours[mask]
        out[n] = float((theirs - ours).norm() / theirs.norm())
    return out


def code_flips(converted, loaded, batch) -> list[tuple[str, float, int, int]]:
    """(linear, input relative difference, FP8 codes differing, codes) on real tokens, file input scales."""
    inputs: dict[str, dict[str, torch.Tensor]] = {"ct": {}, "dq": {}}
    for key, model in (("ct", loaded), ("dq", converted)):
        hooks = [m.register_forward_hook(lambda m, i, o, n=n, d=inputs[key]: d.__setitem__(n, i[0].detach().clone()))
                 for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            model(**batch)
        for h in hooks:
            h.remove()
    mask, rows = batch["attention_mask"].bool(), []
    for n, a in inputs["ct"].items():
        b, s = inputs["dq"][n], loaded.get_submodule(n).input_scale
        if a.dim() == 3:
            a, b = a[mask], b[mask]
        qa, qb = ((t / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) for t in (a, b))
        rows.append((n, float((a - b).norm() / a.norm()), int((qa != qb).sum()), qa.numel()))
    return rows


def main() -> None:
    from transformers import AutoModel

    torch.set_num_threads(1)
    model, tokenizer = minilm.load_minilm()
    calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
    batch = minilm.encode(tokenizer, minilm.EVAL_SENTENCES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, example_kwargs=calibration)
        dq.calibrate(prepared, [calibration], progress=False)
        converted = dq.convert(prepared)
    with tempfile.TemporaryDirectory() as folder:
        dq.save_pretrained(converted, folder)
        loaded = AutoModel.from_pretrained(folder).eval()
        emb_ct = minilm.sentence_embeddings(loaded, batch)  # also decompresses the weights once
    print("1. transformers-loaded vs dbr_quant, embedding cosine:")
    for path in ("bf16", "fp32"):
        with use_cpu_gemm(path):
            print(f"   {path} CPU GEMM path: {_cos(emb_ct, minilm.sentence_embeddings(converted, batch))}")
    with use_cpu_gemm("fp32"):
        same = torch.equal(minilm.sentence_embeddings(converted, batch), emb_ct)
    with use_backend("reference"):  # the exact kernels: fp32 GEMMs, scales on the accumulator (the GPU kernels')
        print(f"   exact kernels:      {_cos(emb_ct, minilm.sentence_embeddings(converted, batch))}")
    print(f"2. fp32 CPU GEMM path (the loader's arithmetic) bit for bit: {same}")
    names = [n for n, _ in converted.named_modules() if n.startswith("encoder.layer.0.") or n == "pooler.dense"]
    print("3. local relative difference per module (loaded module on dbr_quant's inputs):")
    diffs = {}
    for path in ("fp32", "bf16"):
        with use_cpu_gemm(path):
            diffs[path] = local_differences(converted, loaded, batch, names)
    for n in diffs["fp32"]:  # modules that ran
        print(f"   {n:50s} fp32 path {diffs['fp32'][n]:.1e}  bf16 path {diffs['bf16'][n]:.1e}")
    print("4. FP8 codes of each linear's input that differ (exact kernels, real tokens):")
    with use_backend("reference"):
        for n, rel, flips, total in code_flips(converted, loaded, batch):
            print(f"   {n:50s} input rel {rel:.1e}  {flips}/{total} ({flips / total:.1e})")
    hooks = [m.register_forward_hook(lambda m, i, o: o - m.bias + m.bias)
             for m in loaded.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    emb_perturbed = minilm.sentence_embeddings(loaded, batch)
    for h in hooks:
        h.remove()
    print(f"5. loaded model vs itself with y - b + b at every linear: {_cos(emb_ct, emb_perturbed)}")


if __name__ == "__main__":
    main()
