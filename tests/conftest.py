import pytest
import torch
from torch import nn


class Net(nn.Module):
    """Parameters, a persistent buffer, a non-persistent buffer and a nested block."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("scratch", torch.zeros(5), persistent=False)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    m = Net()
    m.norm.running_mean.uniform_()
    m.norm.num_batches_tracked.fill_(7)
    return m
