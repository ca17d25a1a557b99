"""A whole sharded training state through DistributedSnapshotWriter (issue 23).

FSDP2 Linear(8,16)-ReLU-Linear(16,4), each layer ``fully_shard``-ed, AdamW and
LambdaLR; inputs from the global RNG. Two spawned gloo worlds on the CPU
(tests/dist_world.py):

- world 2 (``scenario_state``): 3 steps, save ``{"model", "optim", "sched",
  "rng", "loader"}`` (snapsvc, and DCP with the scheduler as ``Stateful`` as
  the control), 2 more steps (the uninterrupted run); each checkpoint restored
  into fresh, differently seeded objects, 2 steps: bit-identical. Also a rank
  with a key the other lacks, and a step that does not increase.
- world 3 (``scenario_reshard``): the world-2 state restored into 3 ranks.

Then, in this process: ``consolidate`` of the state checkpoint, loaded as a
plain model.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from torch import nn

import snapsvc
from dist_world import run_world

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
from test_fsdp import full, make_plain  # noqa: E402  (after the skip)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]   # a spawned world: minutes here

RESULT_S = 60.0
LOADER = {"epoch": 1, "batch": 3, "order": [3, 1, 2]}


# -- inside the ranks ---------------------------------------------------------------
def make_run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    from torch.distributed.fsdp import fully_shard
    model = make_plain(seed)   # the same seed on every rank: one global model
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()   # the global RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def observed(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> dict:
    """Full parameters, both Adam moments, the lrs and last_epoch (collectives)."""
    out = {"last_epoch": torch.tensor(sched.last_epoch),
           "lrs": torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{name}:{key}"] = full(opt.state[p][key])
    return out


def mismatches(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not torch.equal(a[k], b[k]))


class SchedStateful:
    """The scheduler as DCP's ``Stateful`` (the control)."""

    def __init__(self, sched: object) -> None:
        self.sched = sched

    def state_dict(self) -> dict:
        return self.sched.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.sched.load_state_dict(sd)


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer, sched: object) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": SchedStateful(sched),
            "rng": torch.get_rng_state()}


def outcome(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def scenario_state(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    torch.manual_seed(1234)   # every rank draws the same inputs: its RNG is rank 0's
    model, opt, sched = make_run(0)
    train(model, opt, sched, 3)
    state = {"model": model, "optim": opt, "sched": sched, "rng": torch.get_rng_state(),
             "loader": dict(LOADER)}
    res: dict = {}
    with snapsvc.DistributedSnapshotWriter(os.path.join(tmp, "ckpt"), coord_timeout=60) as w:
        report = w.submit(state, 3, metrics={"loss": 1.5}).result(timeout=RESULT_S)
        res["again"] = outcome(lambda: w.submit(state, 3))
        dcp.save(dcp_state(model, opt, sched), checkpoint_id=os.path.join(tmp, "dcp"))
        at_save = observed(model, opt, sched)
        if rank == 0:
            torch.save(at_save, os.path.join(tmp, "at_save.pt"))
        # a key only rank 1 has: the checkpoint fails on every rank, naming it
        odd = {"model": model, **({"extra": 1} if rank == 1 else {})}
        res["odd"] = outcome(lambda: w.submit(odd, 10).result(timeout=RESULT_S))
    # the single-process writer's advice names the call that works
    res["single"] = outcome(lambda: snapsvc.state.flatten(state))
    res["path"] = report.path
    train(model, opt, sched, 2)
    want = observed(model, opt, sched)

    torch.manual_seed(99)   # fresh objects, another seed and RNG
    model2, opt2, sched2 = make_run(7)
    r = snapsvc.restore_distributed(report.path, {"model": model2, "optim": opt2,
                                                  "sched": sched2})
    res["skipped"], res["loader"] = r.skipped, r.state["loader"]
    res["restored"] = r.restored
    torch.set_rng_state(r.state["rng"])
    res["at_restore"] = mismatches(at_save, observed(model2, opt2, sched2))
    train(model2, opt2, sched2, 2)
    res["resumed"] = mismatches(want, observed(model2, opt2, sched2))

    torch.manual_seed(99)   # the control: DCP
    model3, opt3, sched3 = make_run(7)
    saved = dcp_state(model3, opt3, sched3)
    dcp.load(saved, checkpoint_id=os.path.join(tmp, "dcp"))
    set_state_dict(model3, opt3, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    torch.set_rng_state(saved["rng"])
    train(model3, opt3, sched3, 2)
    res["dcp"] = mismatches(want, observed(model3, opt3, sched3))
    res["memo"] = memo_checks(tmp)
    return res


CHANGES = ("first", "trained", "round trip", "set_", "trained again", "renamed", "resized",
           "replicated", "sharded again")


def memo_checks(tmp: str) -> dict:
    """Saves of one state through one writer, whose walk and pieces are kept between
    submits: each file must hold this rank's pieces as a plan made afresh has them,
    also after FSDP2 gave a parameter's DTensor a new local tensor (.to(): the same
    DTensor, the same shape and dtype, other memory) and after a local tensor was
    given other memory in place (set_); and its piece records as a fresh plan has them,
    also after a plain tensor kept its object under a new key (renamed) and after it
    changed shape in place (resized), and after a DTensor of the same name, shape and
    dtype came with other placements (replicated, sharded again): the kept pieces are
    matched by name, type, the walk's shape and dtype and a DTensor's spec, and hold
    no tensor (issue 34; tests/test_memo_release.py)."""
    from snapsvc.distributed.manifest import read_manifest
    from snapsvc.distributed.shards import ShardMemo, _state_plan
    rank = torch.distributed.get_rank()
    model, opt, sched = make_run(0)
    train(model, opt, sched, 1)
    # an OrderedDict, as a model's state_dict() is: its digest packs as the metadata does
    best = torch.arange(4.0)   # a plain tensor: rank 0 writes it
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    state = {"model": model, "optim": opt, "note": collections.OrderedDict(seen=3),
             "best": {"a": best}, "spread": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
    out = {}
    with snapsvc.DistributedSnapshotWriter(os.path.join(tmp, "memo"), coord_timeout=60) as w:
        for step, change in enumerate(CHANGES, 1):
            if change.startswith("trained"):
                train(model, opt, sched, 1)
            elif change == "round trip":   # FSDP2 puts new local tensors in its DTensors
                model.to(torch.float64)
                model.to(torch.float32)
                train(model, opt, sched, 1)
            elif change == "set_":
                with torch.no_grad():
                    local = model[0].weight._local_tensor
                    local.set_(local.clone() + 1)
            elif change == "renamed":
                state["best"] = {"b": best}
            elif change == "resized":
                best.resize_(6).fill_(2.0)
            elif change == "replicated":   # the same name, shape and dtype; other placements
                state["spread"] = distribute_tensor(torch.arange(8.0), mesh, [Replicate()])
            elif change == "sharded again":
                state["spread"] = distribute_tensor(torch.arange(8.0) + 1, mesh, [Shard(0)])
            fresh, records, _ = _state_plan(state, rank, ShardMemo())
            want = {n: t.clone() for n, t in [*fresh.params, *fresh.buffers,
                                               *((n, t) for _, n, t in fresh.rest)]}
            file = w.submit(state, step).result(RESULT_S).file
            got = snapsvc.read_checkpoint(file).entries
            mine = [r for r in read_manifest(os.path.dirname(file)).ranks if r.rank == rank]
            kept = [{k: e.get(k) for k in r} for e, r in zip(mine[0].entries or [], records)]
            out[change] = (sorted(want) == sorted(got) and len(kept) == len(records)
                           and kept == records, mismatches(want, got))
    return out


def scenario_reshard(rank: int, world: int, tmp: str, path: str, reference: str) -> dict:
    model, opt, sched = make_run(7)
    target = {"model": model, "optim": opt, "sched": sched}
    r = snapsvc.restore_distributed(path, target)
    at_save = torch.load(reference)
    return {"mismatches": mismatches(at_save, observed(model, opt, sched)),
            "loader": r.state["loader"], "last_epoch": sched.last_epoch}


# -- the tests ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state2")
    codes, results = run_world(tmp, 2, scenario_state, run_s=240)
    assert codes == [0, 0] and None not in results, (codes, results)
    return tmp, results


def test_state_saved_and_resumed_bit_exact_at_world_size_2(world2):
    _, results = world2
    for r, res in enumerate(results):
        assert res["at_restore"] == [], (r, res)
        assert res["resumed"] == [], (r, res)    # params, moments, lrs, last_epoch
        assert res["dcp"] == [], (r, res)        # the control
        assert res["loader"] == LOADER
        assert res["skipped"] == ["rng", "loader"]
        assert res["restored"] == ["model", "optim", "sched"]


def test_kept_plan_notices_new_local_tensors(world2):
    _, results = world2
    for res in results:
        assert res["memo"] == {c: [True, []] for c in CHANGES}


def test_differing_keys_and_repeated_step_refused_on_every_rank(world2):
    _, results = world2
    for res in results:
        # a committed step is never written again (a pending one neither: test_distributed)
        assert res["again"].startswith("ValueError: ") \
            and "already holds a complete checkpoint" in res["again"], res["again"]
        assert res["odd"].startswith("DistributedCheckpointError"), res["odd"]
        assert "rank(s) [1]" in res["odd"] and "state['extra']" in res["odd"], res["odd"]
        assert res["single"].startswith("UnsupportedStateError: state['model']['0.weight']: a "
                                        "tensor subclass DTensor"), res["single"]
        assert "DistributedSnapshotWriter(...).submit(state, step)" in res["single"]


def test_reshard_to_world_size_3(world2):
    tmp, results = world2
    (tmp / "w3").mkdir()
    codes, out = run_world(tmp / "w3", 3, scenario_reshard, run_s=240, path=results[0]["path"],
                           reference=str(tmp / "at_save.pt"))
    assert codes == [0, 0, 0], out
    for res in out:
        assert res["mismatches"] == [] and res["loader"] == LOADER and res["last_epoch"] == 3


def test_consolidate_and_plain_restores_at_world_size_1(world2, tmp_path):
    """In this process (no process group): ``consolidate`` gives the model under its own
    names; the state restores into a plain model and an AdamW listing its parameters in
    another order (mapped by name); ``restore_distributed(path, model)`` takes the model."""
    tmp, results = world2
    path = results[0]["path"]
    at_save = torch.load(tmp / "at_save.pt")
    dst = snapsvc.distributed.consolidate(path, tmp_path / "model.fdl")
    model = make_plain(7)
    report = snapsvc.restore(dst, model, strict=True)
    assert report.missing == [] and report.skipped == []
    assert mismatches({n: at_save[n] for n, _ in model.named_parameters()},
                      {n: p.detach() for n, p in model.named_parameters()}) == []

    model = make_plain(7)
    opt = torch.optim.AdamW(list(model.parameters())[::-1], lr=0.5, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)
    r = snapsvc.restore_distributed(path, {"model": model, "optim": opt, "sched": sched})
    assert r.state["loader"] == LOADER and r.metrics == {"loss": 1.5}
    got = {"last_epoch": torch.tensor(sched.last_epoch),
           "lrs": torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)}
    for name, p in model.named_parameters():
        got[name] = p.detach()
        got.update({f"{name}:{k}": v for k, v in opt.state[p].items()})
    assert mismatches(at_save, got) == []

    model = make_plain(7)
    report = snapsvc.restore_distributed(path, model, strict=True)
    assert mismatches({n: at_save[n] for n, _ in model.named_parameters()},
                      {n: p.detach() for n, p in model.named_parameters()}) == []
