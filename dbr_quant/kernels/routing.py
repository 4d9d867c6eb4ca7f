"""The routing plan of a mixture-of-experts block: which rows each expert's grouped GEMM works on.

After the router picks ``top_k`` experts per token (``topk_ids`` [T, top_k]), every (token, slot) pair
becomes one *row* of the grouped problem. :func:`moe_route` sorts the rows by expert (stably, so within
an expert rows stay in token order and results do not depend on the sort implementation) and records
where each expert's rows start. Both backends take this plan: the reference loops over its experts, the
Triton kernels derive their tile schedule from ``expert_offsets`` on the device. Building the plan is
plain torch (argsort, bincount, cumsum) and never syncs with the host, so it can run on the GPU stream.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MoeRouting:
    """Rows sorted by expert. Row ``r`` (sorted position) is slot ``slots[r] = t·top_k + j``: token
    ``t``'s ``j``-th choice. Expert ``e`` owns rows ``expert_offsets[e] : expert_offsets[e + 1]`` (an
    expert that no token picked owns an empty range)."""

    slots: torch.Tensor  # int32 [T·top_k]
    expert_offsets: torch.Tensor  # int32 [E + 1], expert_offsets[0] = 0, expert_offsets[E] = T·top_k
    num_tokens: int
    top_k: int

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def num_rows(self) -> int:
        return self.slots.numel()

    @property
    def tokens(self) -> torch.Tensor:
        """The token each sorted row reads (int64, for indexing)."""
        return self.slots.long() // self.top_k

    @property
    def counts(self) -> torch.Tensor:
        """Rows per expert (int64 [E])."""
        return (self.expert_offsets[1:] - self.expert_offsets[:-1]).long()

    @property
    def row_experts(self) -> torch.Tensor:
        """The expert of each sorted row (int64 [T·top_k])."""
        experts = torch.arange(self.num_experts, device=self.slots.device)
        return torch.repeat_interleave(experts, self.counts, output_size=self.num_rows)

    def row_weights(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """Each sorted row's routing weight, fp32 [T·top_k], from the router's ``topk_weights`` [T, top_k]."""
        if tuple(topk_weights.shape) != (self.num_tokens, self.top_k):
            raise ValueError(f"moe routing: topk_weights must be [{self.num_tokens}, {self.top_k}] like topk_ids, "
                             f"got {tuple(topk_weights.shape)}")
        return topk_weights.reshape(-1).float()[self.slots.long()]


def moe_route(topk_ids: torch.Tensor, num_experts: int) -> MoeRouting:
    """The plan for ``topk_ids`` [T, top_k] (each token's chosen experts, in ``range(num_experts)``)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"moe_route: topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point():
        raise TypeError(f"moe_route: topk_ids must hold integer expert indices, got {topk_ids.dtype}")
    if num_experts < 1 or topk_ids.shape[1] < 1:
        raise ValueError(f"moe_route: needs ≥ 1 expert and top_k ≥ 1, got {num_experts} experts, "
                         f"topk_ids of shape {tuple(topk_ids.shape)}")
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and flat.device.type != "cuda":  # a range check on the GPU would sync: CPU only
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"moe_route: expert ids must lie in [0, {num_experts}), got [{lo}, {hi}]")
    slots = torch.argsort(flat, stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount sizes its output from max(ids), which syncs with the host on a GPU
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return MoeRouting(slots, offsets, topk_ids.shape[0], topk_ids.shape[1])


def input_scale_kind(x_scale: torch.Tensor, num_experts: int, rows: int, op: str) -> str:
    """How an activation scale is laid out: ``"tensor"`` (one value), ``"expert"`` (1-d, one per expert) or
    ``"row"`` (``[rows, 1]``: one per token of a token-order input, e.g. dynamic per-token scales, or one
    per sorted row of a sorted input)."""
    if x_scale.numel() == 1:
        return "tensor"
    if x_scale.dim() == 1 and x_scale.numel() == num_experts:
        return "expert"
    if tuple(x_scale.shape) == (rows, 1):
        return "row"
    raise ValueError(f"{op}: x_scale must be one value, one per expert ([{num_experts}]) or one per input row "
                     f"([{rows}, 1]), got shape {tuple(x_scale.shape)}")


def expert_weight_scale(w_scale: torch.Tensor, num_experts: int, n_w: int, op: str) -> torch.Tensor:
    """``w_scale`` as a fp32 [E, 1] (per expert) or [E, N] (per expert and output channel) view/copy, or a
    0-d tensor when it is a single value."""
    ws = w_scale.detach().float()
    if ws.numel() == 1:
        return ws.reshape(())
    if ws.numel() == num_experts and ws.shape[0] == num_experts:
        return ws.reshape(num_experts, 1)
    if ws.numel() == num_experts * n_w and ws.shape[0] == num_experts:
        return ws.reshape(num_experts, n_w)
    raise ValueError(f"{op}: w_scale must be one value, one per expert ([{num_experts}]) or one per expert and "
                     f"output channel ([{num_experts}, {n_w}]), got shape {tuple(w_scale.shape)}")


def expert_out_scale(out_scale: torch.Tensor, num_experts: int, op: str) -> torch.Tensor:
    """An FP8 output scale as fp32: 0-d (shared) or [E] (the next projection's per-expert input scale)."""
    s = out_scale.detach().float()
    if s.numel() == 1:
        return s.reshape(())
    if s.dim() == 1 and s.numel() == num_experts:
        return s
    raise ValueError(f"{op}: out_scale must be one value or one per expert ([{num_experts}]): a per-token scale "
                     f"needs a whole row, which one output tile does not see; got shape {tuple(out_scale.shape)}")
