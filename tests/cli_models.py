"""Model factories for ``snapsvc migrate --model cli_models:...`` in tests/test_cli.py."""

from __future__ import annotations

import torch
from torch import nn


class Old(nn.Module):
    """The architecture a checkpoint was saved from."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)


class New(nn.Module):
    """``Old`` with its layers renamed: every entry remaps by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)


class Wider(nn.Module):
    """Shapes ``Old`` lacks: the migration is incomplete."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.out = nn.Linear(4, 5)


def old_model() -> nn.Module:
    torch.manual_seed(0)
    return Old()


def new_model() -> nn.Module:
    return New()


def wider_model() -> nn.Module:
    return Wider()


def not_a_model() -> object:
    return {"not": "a module"}


def broken_factory() -> nn.Module:
    raise RuntimeError("factory failed on purpose")


class Factories:
    @staticmethod
    def build() -> nn.Module:
        return New()
