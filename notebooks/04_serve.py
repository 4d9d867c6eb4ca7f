# %% [markdown]
# # 04 · Serve it: an FP8 checkpoint that transformers and vLLM load
#
# A converted model is most useful outside the notebook. `dbr_quant.save_pretrained` writes it in the
# **compressed-tensors** `float-quantized` layout — what llm-compressor writes and what vLLM, SGLang and
# Hugging Face transformers load: FP8 weights with per-channel scales, static per-tensor input scales,
# layers kept in high precision listed under `ignore`. `dbr_quant.load_pretrained` turns the folder back
# into the same converted model, bit for bit.
#
# 1. quantize all-MiniLM-L6-v2 and **save** it;
# 2. **reload with transformers** (`AutoModel.from_pretrained`, compressed-tensors installed) and compare,
#    layer by layer and end to end;
# 3. **reload into dbr_quant** with `load_pretrained`;
# 4. **shards** for big models;
# 5. the **vLLM** command line;
# 6. **a Hub FP8_DYNAMIC folder** written by another tool: load it, calibrate it to static scales, save it.

# %%
import contextlib
import functools
import io
import json
import pathlib
import shutil
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.examples import minilm  # noqa: E402
from dbr_quant.quantize.weights import fp8_weight_of  # noqa: E402

torch.set_num_threads(1)  # 2 cores shared with other jobs: one thread avoids OpenMP contention
torch.set_grad_enabled(False)
hf_logging.disable_progress_bar()
quiet = functools.partial(contextlib.redirect_stderr, io.StringIO())  # compressed-tensors' progress bars
t_start = time.perf_counter()

model, tokenizer = minilm.load_minilm()
calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
evaluation = minilm.encode(tokenizer, minilm.EVAL_SENTENCES)
prepared = dq.prepare(model, example_kwargs=calibration)
dq.calibrate(prepared, [calibration], progress=False)
converted = dq.convert(prepared)

# %% [markdown]
# ## 1. Save
#
# One call writes the safetensors file(s), `config.json` with the `quantization_config`, and
# `dbr_quant.json` (what `load_pretrained` needs beyond the tensors: the scale of every call site, the
# trace's decisions, prepare()'s example inputs — plain JSON). Add the tokenizer, and for an embedding
# model the sentence-transformers pooling files, so serving engines pool like sentence-transformers.

# %%
# (a scratch folder, ~225 MB by the end, that goes away when the notebook ends: see the last cell)
workdir = tempfile.TemporaryDirectory(prefix="dbr_quant_nb_")
folder = pathlib.Path(workdir.name) / "all-MiniLM-L6-v2-fp8"
dq.save_pretrained(converted, folder)
tokenizer.save_pretrained(folder)
for extra in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling"):
    src = minilm.model_dir() / extra
    (shutil.copytree if src.is_dir() else shutil.copy)(src, folder / extra)
for p in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
    print(f"{p.name:<36} {p.stat().st_size / 1e6:7.2f} MB")
fp32_size = (minilm.model_dir() / "model.safetensors").stat().st_size
print(f"KEY size_ratio={(folder / 'model.safetensors').stat().st_size / fp32_size:.3f} (FP8 file / fp32 file)")
qc = json.loads((folder / "config.json").read_text())["quantization_config"]
group = qc["config_groups"]["group_0"]
print(f"targets {group['targets']}: weights {group['weights']['strategy']}, "
      f"inputs {group['input_activations']['strategy']} (dynamic={group['input_activations']['dynamic']}); "
      f"ignore {qc['ignore']}")

# %% [markdown]
# ## 2. Reload with transformers
#
# Software we did not write reads the folder: transformers with compressed-tensors decompresses the FP8
# weights on the first forward and fake-quantizes each linear's input with its `input_scale`.
#
# **Layer by layer** the loaded model computes exactly what the FP8 definition says with dbr_quant's
# bytes and scales: for each linear, its own input `x` gives `fp8(x / s_in)·s_in × (q·s_w)ᵀ + b`.

# %%
with quiet():
    loaded = AutoModel.from_pretrained(folder).eval()
captured = {}
for name, mod in loaded.named_modules():
    if isinstance(mod, torch.nn.Linear):
        mod.register_forward_hook(lambda m, i, o, name=name: captured.__setitem__(name, (i[0], o)))
with quiet():
    emb_loaded = minilm.sentence_embeddings(loaded, evaluation)  # decompresses the weights on this first call

exact = 0
fp8_linears = {n: m for n, m in converted.named_modules() if fp8_weight_of(m) is not None}
record = converted.__dict__["_dbr_record"]
for name, mod in fp8_linears.items():
    w = fp8_weight_of(mod)
    s_in = next(st.scale(op, "input") for st in record.states for op in st.seen_ops if op.weight_owner == name)
    x, y = captured[name]
    x_fp8 = (x / s_in).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s_in
    exact += torch.equal(y, F.linear(x_fp8, w.qdata.float() * w.scale[:, None], mod.bias))
print(f"KEY exact_layers={exact}/{len(fp8_linears)}")

# %% [markdown]
# **End to end** the two differ slightly, and so do dbr_quant's own two kernel paths: on CPU the FP8 GEMM
# runs as a bf16 GEMM whose fp32 accumulator is rounded once to bf16 (fast); `exact=True` reference
# kernels accumulate and return fp32, as the GPU kernels do; transformers computes in fp32 op by op.
# FP8 rounding turns such tiny differences into whole FP8 steps that grow layer by layer, so no two
# implementations agree bitwise end to end. The transformers-loaded model is as far from dbr_quant's
# CPU path as dbr_quant's exact path is, closer still to the exact path, and as close to fp32 as either.

# %%
@contextlib.contextmanager
def exact_gemms():
    """dbr_quant's reference kernels with exact=True (fp32 GEMMs: what the Triton GPU kernels compute)."""
    ref = dq.kernels.reference
    saved = ref.fp8_linear, ref.fp8_matmul
    ref.fp8_linear, ref.fp8_matmul = (functools.partial(f, exact=True) for f in saved)
    try:
        yield
    finally:
        ref.fp8_linear, ref.fp8_matmul = saved


emb_fp8 = minilm.sentence_embeddings(converted, evaluation)
with exact_gemms():
    emb_exact = minilm.sentence_embeddings(converted, evaluation)
emb_fp32 = minilm.sentence_embeddings(model, evaluation)


def cosines(a, b):
    c = (a * b).sum(-1)
    return f"min {c.min():.5f} mean {c.mean():.5f}"


print(f"transformers-loaded vs dbr_quant (CPU kernels)  {cosines(emb_loaded, emb_fp8)}")
print(f"dbr_quant exact kernels vs dbr_quant (CPU)      {cosines(emb_exact, emb_fp8)}")
print(f"transformers-loaded vs dbr_quant exact kernels  {cosines(emb_loaded, emb_exact)}")
print(f"vs fp32: dbr_quant {cosines(emb_fp8, emb_fp32)}, transformers-loaded {cosines(emb_loaded, emb_fp32)}")
cos = (emb_loaded * emb_fp8).sum(-1)
print(f"KEY transformers_vs_dbr_min_cosine={cos.min():.5f}")
print(f"KEY exact_vs_fast_min_cosine={(emb_exact * emb_fp8).sum(-1).min():.5f}")

# %% [markdown]
# ## 3. Back into dbr_quant
#
# `load_pretrained(folder, model)` takes the high-precision architecture (here a fresh copy; for a big
# model, one built from its config), traces it with the saved example inputs, checks that the trace
# made the saved decisions, and restores every FP8 weight and scale. Nothing in the folder is executed:
# safetensors are raw bytes, the rest is JSON. A missing, mis-shaped or non-finite tensor, or a
# truncated file, is an error naming the tensor, and the model passed in is never modified.

# %%
fresh, _ = minilm.load_minilm()
reloaded = dq.load_pretrained(folder, fresh)
print(f"KEY reload_identical={torch.equal(minilm.sentence_embeddings(reloaded, evaluation), emb_fp8)}")

# %% [markdown]
# ## 4. Shards
#
# `max_shard_size` splits the tensors into `model-0000x-of-0000n.safetensors` plus
# `model.safetensors.index.json`, never splitting one module's weight from its scales. Files are written
# one tensor at a time, straight from the tensor's memory: the save needs about one tensor of extra
# memory, not one shard (`benchmarks/checkpoint_memory.py` measures it on a 320 MB Llama).

# %%
sharded = folder.parent / "sharded"
files = dq.save_pretrained(converted, sharded, max_shard_size="5MB")
index = json.loads((sharded / "model.safetensors.index.json").read_text())
print("\n".join(pathlib.Path(f).name for f in files))
print(f"{len(index['weight_map'])} tensors, {index['metadata']['total_size'] / 1e6:.1f} MB")
with quiet():
    resharded = AutoModel.from_pretrained(sharded).eval()
    emb_sharded = minilm.sentence_embeddings(resharded, evaluation)
print(f"KEY sharded_equals_single={torch.equal(emb_sharded, emb_loaded)}")

# %% [markdown]
# ## 5. Serve with vLLM
#
# Not run here (no GPU). vLLM reads the same folder; W8A8 FP8 needs compute capability ≥ 8.9 (Ada,
# Hopper; older GPUs run the weights in FP8 only). It keeps the float32 scales exact and takes the
# largest input scale over q/k/v, which it fuses into one GEMM (dbr_quant's q/k/v scales are equal: they
# quantize the same input).
#
# ```bash
# pip install vllm
# vllm serve /path/to/all-MiniLM-L6-v2-fp8 --runner pooling         # an embedding model (OpenAI /v1/embeddings)
# vllm serve /path/to/llama-fp8                                     # a decoder LM
# vllm serve /path/to/llama-fp8 --kv-cache-dtype fp8                # saved with QConfig(quantize_attention=True)
# ```
#
# or in Python: `vllm.LLM(model=str(folder), runner="pooling").embed(sentences)`.

# %%
print(f"serve with: vllm serve {folder.name} --runner pooling")

# %% [markdown]
# ## 6. An FP8_DYNAMIC folder from the Hub → static scales
#
# The most common FP8 layout on the Hugging Face Hub is compressed-tensors' **FP8_DYNAMIC** preset (what
# llm-compressor writes with `scheme="FP8_DYNAMIC"`): per-channel FP8 weights, inputs scaled per token at run time,
# no calibration data needed. Here compressed-tensors' own writer makes one from MiniLM: its `FP8_DYNAMIC` preset
# applied to every `Linear`, the weight scales from each row's range (`calculate_qparams`, what llm-compressor's
# observer computes), `ModelCompressor.compress_model`, `save_pretrained` + `update_config`. No `dbr_quant.json`:
# a folder of another tool.

# %%
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

hub_model, _ = minilm.load_minilm()
with quiet():
    apply_quantization_config(hub_model, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        "FP8_DYNAMIC", ["Linear"])}))
for mod in hub_model.modules():
    if isinstance(mod, torch.nn.Linear):  # per-channel weight scales from each row's min / max
        w = mod.weight.float()
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        mod.weight_scale.copy_(calculate_qparams(lo, hi, mod.quantization_scheme.weights)[0])
hub_folder = folder.parent / "all-MiniLM-L6-v2-FP8-Dynamic"
with quiet():
    compressor = ModelCompressor.from_pretrained_model(hub_model)
    compressor.compress_model(hub_model)
    hub_model.save_pretrained(hub_folder)
    compressor.update_config(hub_folder)
hub_qc = json.loads((hub_folder / "config.json").read_text())["quantization_config"]
hub_inputs = hub_qc["config_groups"]["group_0"]["input_activations"]
print(f"{sorted(p.name for p in hub_folder.iterdir())}; inputs {hub_inputs['strategy']}, "
      f"dynamic={hub_inputs['dynamic']}")

# %% [markdown]
# **Load it.** `load_pretrained(folder)` without a model builds the architecture `config.json` names with its
# parameters on the meta device and places every tensor as read (no fp32 weight is ever made), then runs the
# folder's scheme with dbr_quant's kernels: per-channel FP8 weights, inputs quantized per token at run time.
# `example_kwargs` are the inputs its trace runs (for a Hugging Face model they default to a short `input_ids`).

# %%
dynamic = dq.load_pretrained(hub_folder, example_kwargs=calibration)
emb_dynamic = minilm.sentence_embeddings(dynamic, evaluation)
print(f"FP8_DYNAMIC loaded by dbr_quant vs fp32: {cosines(emb_dynamic, emb_fp32)}")
print(f"KEY dynamic_vs_fp32_min_cosine={(emb_dynamic * emb_fp32).sum(-1).min():.5f}")

# %% [markdown]
# **Calibrate it to static scales.** `recalibrate=True` returns the model *prepared* instead: the file's FP8
# weights in place and a static per-tensor input observer on every FP8 linear. `calibrate` on a few batches,
# `convert` (it keeps the file's FP8 bytes: nothing is re-quantized), and the model runs with one input scale per
# linear computed once — no per-token amax at run time, the layout vLLM's static FP8 kernels and fused
# norm → quantize epilogues take.

# %%
prepared_static = dq.load_pretrained(hub_folder, example_kwargs=calibration, recalibrate=True)
dq.calibrate(prepared_static, [calibration], progress=False)
static = dq.convert(prepared_static, inplace=True)
kept = all(torch.equal(fp8_weight_of(m).qdata.view(torch.uint8), fp8_weight_of(dynamic.get_submodule(n)).qdata.view(
    torch.uint8)) for n, m in static.named_modules() if fp8_weight_of(m) is not None)
emb_static = minilm.sentence_embeddings(static, evaluation)
print(f"static vs fp32: {cosines(emb_static, emb_fp32)}; the file's FP8 weight bytes kept: {kept}")
print(f"KEY static_vs_fp32_min_cosine={(emb_static * emb_fp32).sum(-1).min():.5f}")
print(f"KEY static_weights_kept={kept}")

# %% [markdown]
# **Save it.** The static model is an ordinary converted model: `save_pretrained` writes a compressed-tensors
# folder whose inputs are static per tensor (an `input_scale` per linear), which transformers (below), vLLM and
# `load_pretrained` read.

# %%
static_folder = folder.parent / "all-MiniLM-L6-v2-FP8-static"
dq.save_pretrained(static, static_folder)
static_inputs = json.loads((static_folder / "config.json").read_text())["quantization_config"]["config_groups"][
    "group_0"]["input_activations"]
with quiet():
    static_loaded = AutoModel.from_pretrained(static_folder).eval()
    emb_static_tf = minilm.sentence_embeddings(static_loaded, evaluation)
print(f"saved: inputs {static_inputs['strategy']}, dynamic={static_inputs['dynamic']}; transformers-loaded vs "
      f"dbr_quant: {cosines(emb_static_tf, emb_static)}")
print(f"KEY static_saved_dynamic={static_inputs['dynamic']}")
print(f"KEY static_transformers_vs_dbr_min_cosine={(emb_static_tf * emb_static).sum(-1).min():.5f}")
print(f"notebook ran in {time.perf_counter() - t_start:.1f} s")

# %% [markdown]
# Remove the scratch folder (keep it instead to look at the files: skip this cell).

# %%
workdir.cleanup()
