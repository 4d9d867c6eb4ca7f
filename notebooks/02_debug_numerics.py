# %% [markdown]
# # 02 · Debugging FP8 numerics: statistics, sensitivity, automatic fallback
#
# `dbr_quant.inspect` looks inside a prepared (calibrated) or converted model while it runs:
#
# * a **YAML config** selects layers by name and enables *features* on them (log tensor statistics,
#   log FP8 quantization error, disable FP8, fake-quantize, change format or scaling) — modelled on
#   Transformer Engine's debug features;
# * **sensitivity analysis** runs the model with only one layer in FP8 at a time and ranks the layers;
# * **auto_fallback** keeps the fewest layers in high precision so the output meets a quality target,
#   and gives back a `QConfig` you can use for the real conversion.
#
# Model: the real all-MiniLM-L6-v2, on the CPU.

# %%
import pathlib
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import dbr_quant as dq  # noqa: E402
import dbr_quant.inspect as dqi  # noqa: E402
from dbr_quant.examples import minilm  # noqa: E402

torch.set_num_threads(1)  # 2 shared cores: one thread avoids OpenMP contention
plt.rcParams.update({"figure.dpi": 72, "font.size": 9})
t_start = time.perf_counter()

model, tokenizer = minilm.load_minilm()
calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
evaluation = minilm.encode(tokenizer, minilm.EVAL_SENTENCES)
prepared = dq.prepare(model, example_kwargs=calibration)
dq.calibrate(prepared, [calibration], progress=False)
print(len(dqi.recorded_layers(prepared)), "layers run in FP8")

# %% [markdown]
# ## 1. A YAML inspect config
#
# Each top-level entry is a *section*: `layers` selects layers (`name_regex` is searched in the layer's
# fully qualified name, `module_type` matches its module class, `kind` is linear / matmul / sdpa) and
# `features` lists what to do with them, with parameters. Here: tensor statistics and FP8 error of
# every linear in the first and last transformer block.

# %%
CONFIG = r"""
first_and_last_block:
  layers:
    name_regex: 'encoder\.layer\.(0|5)\.'
    module_type: Linear
  features:
    LogTensorStats:
      tensors: [input, output]
      stats: [amax, std]
    LogFP8Stats:
      tensors: [input, weight]
      stats: [underflow_pct, saturated_pct, sqnr_db]
"""
# (a scratch folder that goes away when the notebook ends: see the last cell)
workdir = tempfile.TemporaryDirectory(prefix="dbr_quant_nb_")
config_path = pathlib.Path(workdir.name) / "inspect.yaml"
config_path.write_text(CONFIG)

with dqi.session(prepared, config_path) as s:
    minilm.sentence_embeddings(prepared, evaluation)  # one step

print(len(s.records), "records, e.g.", s.records[0])
print()
print(s.table(stats=("amax", "std", "underflow_pct", "saturated_pct", "sqnr_db"), layers=r"layer\.5\.", digits=3))

# %% [markdown]
# How to read it: `sqnr_db` is the signal-to-quantization-noise ratio of the FP8 tensor (≈ 30 dB is
# typical for E4M3; each 6 dB is one bit). `underflow_pct` is the share of non-zero values that
# became zero, `saturated_pct` the share clipped at the format's maximum (evaluation data can exceed
# the calibrated range). Records export with `s.to_csv(path)` / `s.to_json(path)`.
#
# Mistakes in the config are reported with their line:

# %%
BAD = """
mlp_inputs:
  layers:
    name_regex: 'intermediate\\.dense$'
  features:
    LogFP8Stats:
      tensors: [input]
      frequency: 2
"""
try:
    with dqi.session(prepared, BAD):
        pass
except dqi.InspectConfigError as err:
    print("InspectConfigError:", err)

# %% [markdown]
# Features can also change the execution. Below, every MLP input is quantized to **E5M2** instead of
# E4M3 (one more exponent bit, one less mantissa bit) — and the embeddings get measurably worse:

# %%
E5M2 = r"""
mlp_inputs_e5m2:
  layers: {name_regex: 'intermediate\.dense$'}
  features:
    Scaling: {input_format: E5M2}
    LogFP8Stats: {tensors: [input], stats: [sqnr_db]}
"""
reference = minilm.sentence_embeddings(model, evaluation)
e4m3 = minilm.sentence_embeddings(dq.convert(prepared), evaluation)
with dqi.session(prepared, E5M2) as s2:
    e5m2 = minilm.sentence_embeddings(prepared, evaluation)
sq = [r["value"] for r in s2.records]
print(f"MLP-input SQNR with E5M2: {min(sq):.1f}…{max(sq):.1f} dB")
print(f"embedding cosine vs fp32: all E4M3 {(e4m3 * reference).sum(-1).mean():.5f}, "
      f"E5M2 MLP inputs {(e5m2 * reference).sum(-1).mean():.5f}")

# %% [markdown]
# ## 2. Sensitivity: which layer hurts most?
#
# For each of the 37 FP8 linears (6 blocks × 6, plus the pooler, which mean pooling does not use), run the model with **only that layer in FP8** (all others in fp32)
# and measure the sentence embeddings against fp32. On a prepared model this is exact: its fp32
# weights are still there. We use 16 evaluation sentences.

# %%
sens_batch = [minilm.encode(tokenizer, minilm.EVAL_SENTENCES[:16])]
t = time.perf_counter()
sens = dqi.sensitivity(prepared, sens_batch, output_fn=minilm.sentence_embeddings)
print(f"{len(sens)} layers in {time.perf_counter() - t:.1f} s; the five most sensitive:")
for i, r in enumerate(sens[:5]):
    print(f"KEY sens{i + 1} {r.layer} sqnr_db={r.sqnr_db:.2f} cosine={r.cosine:.6f}")
dqi.plot_sensitivity(sens, top=20)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Automatic fallback to a quality target
#
# All linears in FP8 give an embedding cosine of about 0.998. Suppose we need **0.999**.
# `auto_fallback` puts the worst layers (by the ranking above) back in high precision one at a time
# until the target holds, then tries to return each of them to FP8 again (pruning). Each step is
# measured with every other layer in FP8, so interactions between layers are included. The cost is
# the share of linear FLOPs that no longer runs in FP8.

# %%
t = time.perf_counter()
result = dqi.auto_fallback(prepared, sens_batch, target=0.999, metric="cosine",
                           output_fn=minilm.sentence_embeddings, sensitivity=sens)
print(f"{result.evaluations} model evaluations in {time.perf_counter() - t:.1f} s")
print(result.summary())
print(f"KEY target_met={result.met} cosine={result.cosine:.5f} fp8_flop_fraction={result.fp8_flop_fraction:.4f} "
      f"n_fallback={len(result.fallback)}")
dqi.plot_tradeoff(result)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Apply it
#
# `result.qconfig()` is the model's `QConfig` plus one `Override(pattern="^<layer>$", skip=True)` per
# fallback layer. Prepare, calibrate and convert with it as usual, and check the real converted model
# on **all 32** evaluation sentences (half of them were not used to choose the fallback layers).
# (`result.to_yaml()` gives the same selection as an inspect config with `DisableFP8`.)

# %%
qconfig = result.qconfig()
print(qconfig.overrides[:2], "…")
p2 = dq.prepare(model, example_kwargs=calibration, qconfig=qconfig)
dq.calibrate(p2, [calibration], progress=False)
c2 = dq.convert(p2)
cos_all = (minilm.sentence_embeddings(c2, evaluation) * reference).sum(-1)
print(f"KEY applied_cosine={cos_all.mean():.5f} (all FP8: {(e4m3 * reference).sum(-1).mean():.5f})")
print(dq.format_report([r for r in dq.report(c2) if r["kind"] == "linear" and not r["fp8"]]))

# %% [markdown]
# ## 5. Scale granularity: block-scaled FP8
#
# DeepSeek-V3 and the official Qwen3 FP8 releases ship **block-scaled** FP8: one weight scale per 128×128
# block and one activation scale per token per 128 channels, computed at run time — `QConfig.fp8_block()`
# here, `FP8_BLOCK` in llm-compressor. Finer scales keep one outlier from setting the scale of a whole
# tensor or token. E4M3 is a floating-point format, so its rounding error is *relative*: a scale only
# matters for values it pushes below the normal range (2⁻⁶ of the 448 the largest value maps to) and for
# how many values land exactly on the largest one. So expect small differences on a model without extreme
# outliers. Below: the SQNR of each FP8 weight with one scale per output channel vs per 128×128 block
# (a block is finer along the input dimension, coarser along the output one), and of the hidden states
# (each layer's input) per tensor, per token and per token per group of 128 or 32 channels.

# %%
from dbr_quant.kernels.reference import block as reference_block  # noqa: E402


def sqnr_db(ref, approx):
    return 10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - approx.double()).pow(2).sum()).item()


weight_rows = []
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear) and "pooler" not in name:
        w = mod.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 448.0
        per_channel = dq.kernels.dequantize(dq.kernels.quantize(w, scale, dq.FP8Format.E4M3), scale)
        per_block = reference_block.block_dequantize(*dq.kernels.block_quantize_weight(w))
        weight_rows.append((sqnr_db(w, per_channel), sqnr_db(w, per_block)))
gain = [b - c for c, b in weight_rows]
print(f"weight SQNR per channel {min(r[0] for r in weight_rows):.2f}…{max(r[0] for r in weight_rows):.2f} dB; "
      f"128x128 blocks minus per channel {min(gain):+.2f}…{max(gain):+.2f} dB ({len(weight_rows)} linears)")

with torch.no_grad():
    hidden_states = model(**evaluation, output_hidden_states=True).hidden_states
keep = evaluation["attention_mask"].bool()
print("layer input SQNR dB:   per tensor  per token  group 128  group 32")
for i, h in enumerate(hidden_states[:-1]):
    x = h[keep]
    by = [dq.kernels.dynamic_quantize(x, dq.FP8Format.E4M3, per_token) for per_token in (False, True)]
    row = [sqnr_db(x, q.float() * sc) for q, sc in by]
    row += [sqnr_db(x, reference_block.group_dequantize(*dq.kernels.group_quantize(x, g), g)) for g in (128, 32)]
    print(f"encoder.layer.{i}         " + "".join(f"{v:>11.2f}" for v in row))

# %% [markdown]
# Then the whole model under three schemes (activations / weights): the default (calibrated per-tensor
# activations, per-channel weights), dynamic per-token activations with per-channel weights, and the block
# layout. The block model needs no calibration; its launch counts show the block kernels at work.

# %%
schemes = {
    "tensor (static) / channel": dq.QConfig(),
    "token (dynamic) / channel": dq.QConfig(activation=dq.TensorQConfig(granularity="token"), dynamic=True),
    "group 128 / block 128x128": dq.QConfig.fp8_block(),
}
with torch.no_grad():
    ref_hidden = model(**evaluation).last_hidden_state
keep = evaluation["attention_mask"].bool()
scheme_cos = {}
for label, qc in schemes.items():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, example_kwargs=calibration, qconfig=qc)
        if not qc.dynamic:
            dq.calibrate(p, [calibration], progress=False)
        c = dq.convert(p)
    with dq.kernels.count_launches() as launches, torch.no_grad():
        hidden = c(**evaluation).last_hidden_state
    scheme_cos[label] = (minilm.sentence_embeddings(c, evaluation) * reference).sum(-1).mean().item()
    print(f"{label:<27} embedding cosine {scheme_cos[label]:.5f}  hidden-state SQNR "
          f"{sqnr_db(ref_hidden[keep], hidden[keep]):.2f} dB")
print("block model launches per forward:", dict(launches))
print(f"KEY block_cosine={scheme_cos['group 128 / block 128x128']:.5f} "
      f"token_cosine={scheme_cos['token (dynamic) / channel']:.5f}")

# %% [markdown]
# On MiniLM, whose activations and weights have no extreme outliers, the finer scales move the figures only
# slightly: what the block layout buys here is running and comparing against the block-scaled checkpoints
# people ship, and headroom for models whose activations do have outlier channels (a per-token scale spans
# all of a token's channels; a group scale 128 of them).

# %% [markdown]
# ## 6. GPTQ weight rounding, and a fallback that spends a FLOP budget
#
# Weights cause more of MiniLM's FP8 error than activations. `QConfig(weight_rounding="gptq")` rounds each
# linear's weights onto the same FP8 grid (same scales, same checkpoint layout) with GPTQ error feedback:
# `calibrate` accumulates the Hessian of each linear's inputs, one fold per calibration batch, and `convert`
# chooses the damping by cross-validation between folds — so calibrate with several batches (here 4 of 4
# sentences). To keep this cell short it tries 4 dampings instead of the default 10
# (`benchmarks/gptq_fallback_minilm.py` runs the defaults). Then
# `auto_fallback(rank="error_per_flop", max_high_precision_flops=0.1)` keeps in high precision the layers
# with the most output error per FLOP, within 10 % of the linear FLOPs. The fallback is chosen on 4
# calibration sentences; every cosine below is on the 32 held-out evaluation sentences.

# %%
import math  # noqa: E402

from dbr_quant.runtime.hessians import gptq_report  # noqa: E402

calib_batches = [minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES[i:i + 4]) for i in range(0, 16, 4)]
choose_on = [calib_batches[0]]
gptq_options = dq.GPTQOptions(dampings=(0.3, 1.0, 3.0, math.inf))
print("rounding  convert s  all FP8: mean / min cos   fallback ≤ 10 % FLOPs: mean / min cos, FP8 FLOPs, layers")
for rounding in ("nearest", "gptq"):
    p = dq.prepare(model, example_kwargs=calibration, qconfig=dq.QConfig(weight_rounding=rounding, gptq=gptq_options))
    dq.calibrate(p, calib_batches, progress=False)
    t = time.perf_counter()
    c = dq.convert(p)
    seconds = time.perf_counter() - t
    cos = (minilm.sentence_embeddings(c, evaluation) * reference).sum(-1)
    res = dqi.auto_fallback(c, choose_on, reference=model, output_fn=minilm.sentence_embeddings,
                            rank="error_per_flop", max_high_precision_flops=0.1)
    with dqi.fallback_applied(c, res.fallback, reference=model):  # high-precision layers: original weights
        cos_fb = (minilm.sentence_embeddings(c, evaluation) * reference).sum(-1)
    print(f"{rounding:<8} {seconds:>9.1f}  {cos.mean():.5f} / {cos.min():.5f}          {cos_fb.mean():.5f} / "
          f"{cos_fb.min():.5f}, {100 * res.fp8_flop_fraction:.1f} %, {len(res.fallback)}")
    print(f"KEY {rounding}_cosine={cos.mean():.5f} {rounding}_fallback_cosine={cos_fb.mean():.5f} "
          f"{rounding}_fallback_fp8={res.fp8_flop_fraction:.4f}")
dampings = [r.damping.damping for r in gptq_report(c).values()]
print("GPTQ dampings chosen:", {f"{d:g}": dampings.count(d) for d in sorted(set(dampings))})
print(res.curve_table())

# %% [markdown]
# Measured when this notebook was written (1 thread, shared CPU): all FP8 0.99777 → 0.99809 mean cosine with
# GPTQ, at the same scales and checkpoint layout, while the worst sentence does not improve (0.99695 → 0.99674);
# with ≤ 10 % of the linear FLOPs in high precision, 0.99846 (nearest) and 0.99871 (GPTQ) at 90.3 % FP8. The
# issue's goal (≥ 0.9983 all FP8, ≥ 0.999 at ≥ 90 % FP8, held out) is not reached. The curve above is measured
# on the calibration sentences, which GPTQ has fitted: it promises more than the held-out sentences give — choose
# the fallback on sentences GPTQ did not see when you can.

# %%
print(f"notebook ran in {time.perf_counter() - t_start:.1f} s")

# %% [markdown]
# Remove the scratch folder (keep it instead to look at the files: skip this cell).

# %%
workdir.cleanup()
