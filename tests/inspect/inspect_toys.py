"""Toy models for the inspect tests."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Attn(nn.Module):
    """q/k/v linears, an explicit q·kᵀ matmul + softmax + p·v, and an SDPA on the same q/k/v."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = torch.matmul(q, k.transpose(-1, -2)) / 4.0
        y = torch.matmul(torch.softmax(s, dim=-1), v)
        y = y + F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        return self.o(y)


def batches(n: int = 4, shape=(8, 16)) -> list[torch.Tensor]:
    return [torch.randn(*shape) for _ in range(n)]
