"""Incremental mode never writes a stale tensor (issue 20, section 1).

Kernels that write a tensor directly leave its ``_version`` and storage
pointer as they were: BatchNorm's running statistics in train mode, the
fused Adam, AdamW and SGD steps, and parameters that are views into a flat
vector updated through that vector. Each case submits several times with
``incremental=True`` and checks every file against the state at its submit,
with one slot (the same slot reused every time) and with two.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import snapsvc

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]


def state_of(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def run_rounds(w: snapsvc.SnapshotWriter, name: str, model: nn.Module, step,
               rounds: int = 4) -> list[dict[str, torch.Tensor]]:
    """Submit ``model`` as ``name<i>.fdl`` after each ``step()``; the state at each submit.

    The rounds of one model follow each other, so its pool (and what its
    slots hold) is kept from one submit to the next.
    """
    wanted = []
    for i in range(rounds):
        if i:
            step()
        wanted.append(state_of(model))
        w.submit(model, f"{name}{i}.fdl").result(timeout=60)
    return wanted


def stale(directory, name: str, wanted: list[dict[str, torch.Tensor]]) -> list[str]:
    """``file: entry`` for each entry that differs from the state at its submit."""
    out = []
    for i, want in enumerate(wanted):
        got = snapsvc.read_checkpoint(directory / f"{name}{i}.fdl").entries
        out += [f"{name}{i}.fdl: {k}" for k, v in want.items() if not torch.equal(got[k], v)]
    return out


class Convnet(nn.Module):
    """A frozen feature extractor whose BatchNorm still tracks statistics, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.features.requires_grad_(False)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def batchnorm_case():
    m = Convnet().train()

    def step() -> None:
        with torch.no_grad():
            m(torch.randn(32, 8))  # updates running_mean/var without a _version bump

    return m, step


def fused_case(cls):
    def make():
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        opt = cls(m.parameters(), lr=0.1, fused=True)

        def step() -> None:
            m(torch.randn(4, 8)).square().sum().backward()
            opt.step()  # a fused kernel: no _version bump
            opt.zero_grad()

        return m, step
    return make


def flat_case(frozen: bool):
    def make():
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        m.requires_grad_(not frozen)
        flat = nn.utils.parameters_to_vector(m.parameters()).detach().clone()
        nn.utils.vector_to_parameters(flat, m.parameters())  # each parameter now views ``flat``

        def step() -> None:
            flat.add_(torch.randn_like(flat))  # bumps flat's _version, not the parameters'

        return m, step
    return make


CASES = {"batchnorm": batchnorm_case, "adam": fused_case(torch.optim.Adam),
         "adamw": fused_case(torch.optim.AdamW), "sgd": fused_case(torch.optim.SGD),
         "flat": flat_case(False), "flatfrozen": flat_case(True)}


@pytest.mark.parametrize("slots", [1, 2])
def test_in_place_kernel_updates_are_never_skipped(tmp_path, slots):
    """BatchNorm in train mode, fused Adam/AdamW/SGD, parameters viewing a flat
    vector (trainable and frozen): every file holds the state at its submit."""
    torch.manual_seed(0)
    found = []
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=slots) as w:
        for name, make in CASES.items():
            model, step = make()
            wanted = run_rounds(w, name, model, step)
            assert any(not torch.equal(a, b) for a, b in zip(wanted[0].values(),
                                                              wanted[-1].values())), name
            found += stale(tmp_path, name, wanted)
    assert not found, f"stale tensors written: {found}"


def test_check_mode_does_not_blame_data_writes_for_kernel_updates(tmp_path, caplog):
    """BatchNorm, fused steps and flat vectors are copied every time, so the
    check has nothing to catch; a real miss is named with the right cause."""
    torch.manual_seed(0)
    m = Convnet().train()
    opt = torch.optim.Adam(m.head.parameters(), lr=0.1, fused=True)

    def step() -> None:
        m(torch.randn(32, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="snapsvc"):
        with snapsvc.SnapshotWriter(tmp_path, incremental="check", slots=1) as w:
            wanted = run_rounds(w, "c", m, step)
    assert stale(tmp_path, "c", wanted) == []
    assert "changed without a _version bump" not in caplog.text, caplog.text
    # what incremental mode does skip, a frozen parameter, written through .data
    with snapsvc.SnapshotWriter(tmp_path, incremental="check", slots=1) as w:
        w.submit(m, "d.fdl").result(timeout=60)
        m.features[0].bias.data.add_(1)
        want = state_of(m)
        with caplog.at_level(logging.WARNING, logger="snapsvc"):
            w.submit(m, "e.fdl").result(timeout=60)
    got = snapsvc.read_checkpoint(tmp_path / "e.fdl").entries
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert "'features.0.bias' (a frozen parameter) changed without a _version bump" in caplog.text


def test_incremental_still_skips_a_frozen_backbone(tmp_path):
    """What may be skipped: frozen parameters (no grad, not part of a larger storage)."""
    torch.manual_seed(0)
    m = Convnet().train()
    m.features[0].weight.data = torch.randn(16, 8)  # its own storage
    opt = torch.optim.Adam(m.head.parameters(), lr=0.1, fused=True)
    frozen = sum(p.numel() * 4 for p in m.features.parameters())
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=1) as w:
        w.submit(m, "a.fdl").result(timeout=60)
        full = w.stats()["staged_bytes"]
        m(torch.randn(32, 8)).sum().backward()
        opt.step()
        w.submit(m, "b.fdl").result(timeout=60)
        assert w.stats()["staged_bytes"] - full == full - frozen


class _DataSGD(torch.optim.Optimizer):
    """A hand-written optimizer that writes through ``p.data``: no ``_version`` bump."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def gan_case(make_opt):
    """The GAN pattern: the discriminator is unfrozen, trained (its step bumps no
    ``_version``), frozen again, and ``zero_grad`` leaves ``.grad`` None: at every
    submit it looks frozen and untouched."""
    def make():
        m = nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)})
        m["d"].requires_grad_(False)
        opt = make_opt(m["d"].parameters())

        def step() -> None:
            m["d"].requires_grad_(True)
            m["d"](m["g"](torch.randn(8, 4)).detach()).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            m["d"].requires_grad_(False)

        return m, step
    return make


GAN_CASES = {"gan-fused-adam": gan_case(lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True)),
             "gan-data-sgd": gan_case(_DataSGD)}


@pytest.mark.parametrize("slots", [1, 2])
def test_a_parameter_trained_between_submits_is_never_skipped(tmp_path, slots):
    """Issue 30 item 2: frozen at every submit, trained in between: every file holds
    the state at its submit, as ``incremental="check"`` would write it."""
    torch.manual_seed(0)
    found = []
    with snapsvc.SnapshotWriter(tmp_path, incremental=True, slots=slots) as w:
        for name, make in GAN_CASES.items():
            model, step = make()
            wanted = run_rounds(w, name, model, step)
            assert not torch.equal(wanted[0]["d.weight"], wanted[-1]["d.weight"]), name
            found += stale(tmp_path, name, wanted)
    assert not found, f"stale tensors written: {found}"
