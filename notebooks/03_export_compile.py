# %% [markdown]
# # 03 · From define-by-run to a graph: rewrite, torch.compile, torch.export
#
# A converted model runs FP8 by intercepting torch calls at run time (define-by-run). For deployment
# you usually want a **graph**: `dbr_quant.fx_rewriter.rewrite(converted)` captures the converted model
# as a `torch.fx.GraphModule` of aten ops plus `dbr_quant::*` custom ops (quantize, fp8_linear, …).
# That graph needs no interception, compiles with `torch.compile(fullgraph=True)` and exports with
# `torch.export`. At the end we time every variant side by side **on this CPU**.

# %%
import copy
import pathlib
import statistics
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")

import torch  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.examples import minilm  # noqa: E402
from dbr_quant.fx_rewriter import compile_frozen, rewrite  # noqa: E402

torch.set_num_threads(1)        # 2 cores shared with other jobs: one thread avoids OpenMP contention
torch.set_grad_enabled(False)   # inference only (the FP8 custom ops have no autograd formula)
t_start = time.perf_counter()

model, tokenizer = minilm.load_minilm()
calibration = minilm.encode(tokenizer, minilm.CALIBRATION_SENTENCES)
evaluation = minilm.encode(tokenizer, minilm.EVAL_SENTENCES)
prepared = dq.prepare(model, example_kwargs=calibration)
dq.calibrate(prepared, [calibration], progress=False)
converted = dq.convert(prepared)

# %% [markdown]
# ## 1. Rewrite
#
# `rewrite` runs a non-strict `torch.export` of the converted model with dbr_quant's interception
# active, routing each FP8 kernel call to a `torch.library` custom op. Batch and sequence dimensions
# stay dynamic. Here is the head of the generated code, then the lines of the first FP8 linear:

# %%
t = time.perf_counter()
graph = rewrite(converted)
print(f"rewrite took {time.perf_counter() - t:.1f} s; {len(graph.graph.nodes)} graph nodes")
code = graph.code.strip().splitlines()
print("\n".join(code[:12]))
print("    ...")
first = next(i for i, line in enumerate(code) if "dbr_quant.fp8_linear" in line)
print("\n".join(code[first - 3:first + 1]))
ops = [n.target for n in graph.graph.nodes if n.op == "call_function" and "dbr_quant" in str(n.target)]
print("\ndbr_quant custom ops in the graph:", {str(o): ops.count(o) for o in set(ops)})

# %% [markdown]
# The graph computes exactly what the converted eager model computes (same kernels, same order), on
# inputs of any batch and sequence length:

# %%
eager_out = converted(**evaluation).last_hidden_state
graph_out = graph(**evaluation).last_hidden_state
print(f"KEY graph_equals_eager={torch.equal(eager_out, graph_out)} "
      f"max_abs_diff={(eager_out - graph_out).abs().max().item():.3g}")
short = minilm.encode(tokenizer, minilm.EVAL_SENTENCES[:3])  # another shape
print("other shape equal:", torch.equal(converted(**short).last_hidden_state, graph(**short).last_hidden_state))

# %% [markdown]
# ## 2. torch.compile
#
# `fullgraph=True` makes any graph break an error, so a successful compile proves the whole model is one
# graph. On CPU, dbr_quant hands inductor a decomposition of each FP8 op (exact FP8 rounding in fp32
# arithmetic), so quantization fuses into the LayerNorm / GELU / residual kernels. Inductor rounds a few
# fp32 operations differently from eager (no FMA in the epilogue, its own LayerNorm sums); a 1-ulp change
# can flip an FP8 rounding and the flips spread through the layers. So the compiled output is not
# bit-identical: we compare sentence embeddings, with each other and against fp32.
#
# `compile_frozen` compiles with inductor's *freezing*: the weights become constants, the FP8 → bf16
# weight upcast is folded at compile time and oneDNN gets pre-packed weights (the compiled artifact holds
# bf16 copies of the weights).

# %%
t = time.perf_counter()
compiled = torch.compile(graph, fullgraph=True)
compiled_out = compiled(**evaluation).last_hidden_state
print(f"compile + first call: {time.perf_counter() - t:.1f} s")
t = time.perf_counter()
frozen = compile_frozen(graph)
frozen(**evaluation)
print(f"compile_frozen + first call: {time.perf_counter() - t:.1f} s")
err = (compiled_out - eager_out).abs().max().item()
emb = {name: minilm.sentence_embeddings(m, evaluation) for name, m in
       {"fp32": model, "eager": converted, "compiled": compiled, "frozen": frozen}.items()}
print(f"max |compiled - eager| on hidden states: {err:.3g} (largest value {eager_out.abs().max().item():.1f})")
print(f"KEY compiled_vs_eager_cosine={(emb['compiled'] * emb['eager']).sum(-1).min().item():.6f} (worst sentence)")
print(f"KEY frozen_vs_eager_cosine={(emb['frozen'] * emb['eager']).sum(-1).min().item():.6f} (worst sentence)")
print("embedding cosine vs fp32 (mean): " + ", ".join(
    f"{k} {(emb[k] * emb['fp32']).sum(-1).mean().item():.5f}" for k in ("eager", "compiled", "frozen")))

# %% [markdown]
# ## 3. torch.export: save and load
#
# The exported program is a self-contained file: custom ops are registered when `dbr_quant` is imported.

# %%
# (a scratch folder that goes away when the notebook ends: see the last cell)
workdir = tempfile.TemporaryDirectory(prefix="dbr_quant_nb_")
path = pathlib.Path(workdir.name) / "minilm_fp8.pt2"
exported = torch.export.export(graph, (), evaluation)
torch.export.save(exported, path)
loaded = torch.export.load(path)
loaded_out = loaded.module()(**evaluation).last_hidden_state
print(f"saved {path.stat().st_size / 1e6:.1f} MB;",
      f"KEY export_equals_eager={torch.equal(loaded_out, eager_out)}")

# %% [markdown]
# ## 4. Timing, side by side on this CPU
#
# Six variants on the 32 evaluation sentences: fp32 eager, bf16 eager, FP8 converted eager, FP8
# rewritten graph (eager FX), the compiled graph and the frozen compiled graph. Rounds are **interleaved** (each round runs every
# variant once, in turn), so drifting load on this shared machine hits all variants alike; we report the
# median over rounds. One thread, CPU reference kernels: these numbers say nothing about a GPU.

# %%
bf16 = copy.deepcopy(model).to(torch.bfloat16)
variants = {
    "fp32 eager": lambda: model(**evaluation),
    "bf16 eager": lambda: bf16(**evaluation),
    "FP8 eager (converted)": lambda: converted(**evaluation),
    "FP8 rewritten (FX)": lambda: graph(**evaluation),
    "FP8 rewritten + compile": lambda: compiled(**evaluation),
    "FP8 compile_frozen": lambda: frozen(**evaluation),
}
for f in variants.values():  # warm-up
    f()
times = {k: [] for k in variants}
for _ in range(9):
    for name, f in variants.items():
        t = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - t)
base = statistics.median(times["fp32 eager"])
print(f"Measured on this CPU: {torch.get_num_threads()} thread, torch {torch.__version__}, 9 interleaved rounds")
print(f"{'variant':<26}{'median ms':>10}{'vs fp32':>9}")
for name, ts in times.items():
    med = statistics.median(ts)
    print(f"{name:<26}{1000 * med:>10.1f}{med / base:>8.2f}x")
print(f"notebook ran in {time.perf_counter() - t_start:.1f} s")

# %% [markdown]
# Remove the scratch folder (keep it instead to look at the files: skip this cell).

# %%
workdir.cleanup()
