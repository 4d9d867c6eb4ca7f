"""How a kernel is declared once (:class:`KernelOp`) and how its functions are generated from that declaration.

A kernel's declaration (``kernels/table.py``) is one Python function: its signature is the kernel's signature
(names, annotations, defaults, keyword-only markers), its docstring the kernel's documentation, and its body
the rule for the output's shape and dtype (what a fake implementation returns while a graph is traced). The
decorator :func:`kernel_op` adds what the declaration cannot say: the launch counter(s), which argument's
device picks the backend, the reference module and the Triton kernel. From that:

* ``dbr_quant.kernels`` generates the public entry point (graph op while capturing, launch count, dispatch);
* ``kernels.triton.backend`` generates the forwarding to the Triton kernel;
* ``fx_rewriter.ops`` generates the ``torch.library`` op, its fake and the capture-time entry (``GraphOps``).

Generated functions are compiled once, at import, from source text with the declaration's explicit parameter
list (as :mod:`dataclasses` generates ``__init__``): a call costs what a hand-written function costs, with no
``*args`` packing, per-call dicts or signature binding, and a traceback shows the generated source.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """Where the Triton backend's implementation of an op lives: ``dbr_quant.kernels.triton.<module>``, its
    function ``function`` (default: the op's name), and ``output``: the element of that function's result
    tuple that is the op's result (None: the whole result)."""

    module: str
    function: str | None = None
    output: int | None = None


@dataclasses.dataclass(frozen=True)
class KernelOp(Generic[F]):
    """One FP8 kernel, declared once.

    ``declaration``: the kernel's signature, docstring and output rule (see the module docstring).
    ``launches``: the launch counter name(s) a call records (``kernels.count_launches``).
    ``reference``: the module whose function of the op's name is the reference implementation.
    ``triton``: the Triton kernel; None when there is none, and then ``without_triton`` says why other
    backends cannot run the op (an error raised on them), or is empty: the reference runs on every backend.
    ``device``: the parameter whose tensor's device picks the backend (default: the first).
    ``launch``: for an op that is more than one call of the backend's function of its name (``fp8_mlp``: two
    GEMMs), runs it. ``more_launches``: for an op whose launch count depends on its arguments, records the
    launches beyond ``launches`` (called only while launches are counted). Both are called with the backend
    module, then the op's arguments that their further parameters name (:meth:`hook_arguments`).
    ``fp8_tensor_cores``: whether its Triton kernel needs FP8 tensor cores (sm_89+); False (the weight-only GEMM,
    bf16/fp16 MMA) runs it on every CUDA GPU under the default backend choice, where the FP8 ops take the CPU
    backend's torch path below sm_89.
    """

    declaration: F
    launches: tuple[str, ...]
    reference: ModuleType
    triton: TritonKernel | None = None
    without_triton: str = ""
    device: str = ""
    launch: Callable[..., Any] | None = None
    more_launches: Callable[..., None] | None = None
    fp8_tensor_cores: bool = True

    def __post_init__(self) -> None:
        if not self.device:
            object.__setattr__(self, "device", self.parameters[0].name)
        if self.device not in self.signature.parameters:
            raise TypeError(f"dbr_quant.kernels.{self.name}: device={self.device!r} is not one of its parameters")
        for hook in (self.launch, self.more_launches):
            if hook is not None:
                self.hook_arguments(hook)

    def hook_arguments(self, hook: Callable[..., Any]) -> list[str]:
        """The op's arguments that ``hook``'s parameters after the first (the backend module) name."""
        names = list(inspect.signature(hook).parameters)[1:]
        unknown = [n for n in names if n not in self.signature.parameters]
        if unknown:
            raise TypeError(f"dbr_quant.kernels.{self.name}: {hook.__name__} takes {unknown}, which are not "
                            f"parameters of {self.name}; name its parameters after the op's")
        return names

    @property
    def name(self) -> str:
        return self.declaration.__name__

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.declaration)

    @property
    def parameters(self) -> tuple[inspect.Parameter, ...]:
        return tuple(self.signature.parameters.values())

    @property
    def doc(self) -> str | None:
        return self.declaration.__doc__


def kernel_op(*, launches: str | tuple[str, ...], reference: ModuleType, triton: TritonKernel | None = None,
              without_triton: str = "", device: str = "",
              launch: Callable[..., Any] | None = None,
              more_launches: Callable[..., None] | None = None,
              fp8_tensor_cores: bool = True) -> Callable[[F], KernelOp[F]]:
    """``@kernel_op(launches="quantize", reference=dense, triton=TritonKernel("quantize"))`` over a kernel's
    declaration (see the module docstring): the :class:`KernelOp`."""
    counters = (launches,) if isinstance(launches, str) else launches

    def declare(declaration: F) -> KernelOp[F]:
        return KernelOp(declaration, counters, reference, triton, without_triton, device, launch, more_launches,
                        fp8_tensor_cores)

    return declare


def call_arguments(parameters: Sequence[inspect.Parameter], convert: Callable[[inspect.Parameter], str] | None = None,
                   *, positional: bool = False) -> str:
    """The argument list that passes ``parameters`` on as declared (keyword-only ones by keyword, unless
    ``positional``); ``convert(p)`` gives the expression for each (default: its name)."""
    parts = []
    for p in parameters:
        value = p.name if convert is None else convert(p)
        parts.append(f"{p.name}={value}" if p.kind is p.KEYWORD_ONLY and not positional else value)
    return ", ".join(parts)


def positional(parameters: Sequence[inspect.Parameter]) -> list[inspect.Parameter]:
    """The parameters as a graph op takes them: all positional, in order, without defaults."""
    return [p.replace(kind=p.POSITIONAL_OR_KEYWORD, default=p.empty) for p in parameters]


def build_function(name: str, parameters: Sequence[inspect.Parameter], body: Sequence[str], *,
                   module_globals: dict[str, Any], bound: dict[str, Any] | None = None,
                   doc: str | None = None, annotations: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Compile ``def name(<parameters>): <body>`` as a function of the module whose ``globals()`` are
    ``module_globals``: the body reads that module's globals at call time, as a hand-written function there
    would (so a module global patched later is seen), and the names in ``bound`` as closure variables.

    Defaults are bound once, at definition, as in any ``def``. The source is registered with :mod:`linecache`
    so a traceback through the function shows its lines."""
    bound = dict(bound or {})
    rendered, keyword_only = [], False
    for p in parameters:
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            rendered.append("*")
            keyword_only = True
        if p.default is p.empty:
            rendered.append(p.name)
        else:
            bound[f"_default_{p.name}"] = p.default
            rendered.append(f"{p.name}=_default_{p.name}")
    module = module_globals["__name__"]
    source = (f"def _make({', '.join(bound)}):\n"  # the closure over ``bound``
              f"    def {name}({', '.join(rendered)}):\n" + "".join(f"        {line}\n" for line in body)
              + f"    return {name}\n")
    filename = f"<{module}.{name}, generated by dbr_quant.kernels.op_table>"
    factory: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), module_globals, factory)  # noqa: S102  (our own source, built above)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    fn = factory["_make"](**bound)
    fn.__module__, fn.__qualname__, fn.__doc__ = module, name, doc
    fn.__annotations__ = dict(annotations or {})
    return fn
