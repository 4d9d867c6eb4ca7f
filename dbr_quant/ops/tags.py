"""What dbr_quant keeps on objects it does not own: one ``ModuleTag`` per module of a prepared model, and the
mark on the convert run's placeholder tensors.

The tag is a plain instance attribute (``module.__dict__[TAG]``), not a submodule, parameter or buffer, so it
never shows in ``state_dict`` / ``named_modules`` / ``parameters``. deepcopy and pickle copy it with the rest of
the module's ``__dict__``: ``stacked_after`` then names the copy's gate (deepcopy's memo), exactly as the loose
``_dbr_*`` attributes it replaces were copied. It lives here, in ``ops``, because ``ops.basic`` is the lowest
layer that reads it (``stacked_after``); prepare (``api``) writes it, the runtime reads it on every module call.
The root's ``ModelRecord`` stays the root's own attribute (``runtime.runs``), one layer above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the type only: moe is a higher layer, and only moe builds or reads the spec
    from dbr_quant.moe.experts import ExpertsSpec

__all__ = ["TAG", "ModuleTag", "tag_of", "fqn_of", "experts_of", "unstack", "is_placeholder", "mark_placeholder"]

TAG = "_dbr_tag"  # the key of a module's tag in its __dict__


@dataclass(slots=True, eq=False)
class ModuleTag:
    """Everything dbr_quant keeps on one module of a prepared model (slots: the runtime reads ``experts`` and
    ``norm`` on every module call, ``fqn`` on every linear). Mutable: the trace, convert and load fill it in."""

    fqn: str | None  # the module's name in the prepared model ("" for the root; None: not in the model's tree)
    owner: bool  # owns records: the root and every module with children (their ops are recorded in its state)
    experts: ExpertsSpec | None = None  # a recognised experts module, called as one op (moe.experts.mark_experts)
    norm: bool | None = None  # the trace's verdict on an RMSNorm-like module (None: never judged)
    stacked_after: nn.Module | None = None  # convert: this up projection's FP8 rows follow this gate's in one buffer
    inner_forward: Callable[..., Any] | None = None  # an instance forward there before prepare (accelerate's)
    # the forward prepare installed (``functools.partial(api._entry_forward, root, module)``): a run of this model
    # calls the module's own forward directly while the module's ``forward`` is still this wrapper
    entry_forward: functools.partial[Any] | None = None


def tag_of(module: nn.Module) -> ModuleTag | None:
    """The module's tag, None for a module that is not part of a prepared model."""
    return module.__dict__.get(TAG)


def fqn_of(module: nn.Module) -> str | None:
    tag = module.__dict__.get(TAG)
    return None if tag is None else tag.fqn


def experts_of(module: nn.Module) -> ExpertsSpec | None:
    """The experts spec of a recognised MoE experts module (called as one op: moe/experts.py), else None."""
    tag = module.__dict__.get(TAG)
    return None if tag is None else tag.experts


def unstack(module: nn.Module) -> None:
    """Forget that the module's FP8 rows follow a gate's in one buffer (its weight was replaced by a separate one)."""
    tag = module.__dict__.get(TAG)
    if tag is not None:
        tag.stacked_after = None


# A placeholder stands for an intermediate of a fused subgraph that is not computed yet (runtime/convert_run.py).
# It is an empty meta tensor with this attribute set: the flag has to travel with the tensor through user code
# (hooks, containers) that the runtime does not see, and a tensor subclass would change torch's dispatch.
_PLACEHOLDER = "_dbr_placeholder"


def mark_placeholder(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _PLACEHOLDER, True)
    return t


def is_placeholder(t: Any) -> bool:
    return getattr(t, _PLACEHOLDER, False)
