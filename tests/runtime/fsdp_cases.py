"""The FSDP2 x pipeline and checkpoint cases, run on every rank of a worker pool.

The whole model is `Net`: four blocks ``layers.0`` .. ``layers.3`` (Linear + tanh, float64). A stage
is a copy of the whole model with the blocks it does not hold deleted, so its parameters keep the
whole model's names (``layers.2.weight``): what checkpoints are keyed by and what the tests compare
by. The reference is one process running the whole model on the whole batch (`reference_run`).
Tied cases make the weight of some blocks the very Parameter of ``layers.0.weight`` (`whole_model`'s
`tie`): the reference's gradient of it is the sum over its uses, recorded under every name.

Tolerances: float64 everywhere; the pipeline sums the same products in another order (microbatch
and replica sums), so results agree to rounding: rtol 1e-9, atol 1e-11.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zbpp import Pipeline
from zbpp.runtime import PipelineError
from zbpp.modules import Linear as ZLinear
from zbpp.schedules import build

H = 4  # feature width
ROWS = 8  # rows of a step's whole batch (all replicas together)
M = 4  # microbatches
RTOL, ATOL = 1e-9, 1e-11  # see the module docstring


class Net(nn.Module):
    """Blocks ``layers.<i>`` (Linear + tanh), applied in index order, whichever of them it holds."""

    def __init__(self, kind: str = "plain", blocks: int = 4) -> None:
        super().__init__()

        def linear() -> nn.Module:
            if kind in ("delayed", "fused"):  # fused: weight gradients accumulate into main_grad
                return ZLinear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64,
                               fuse_wgrad_accumulation=kind == "fused")
            return nn.Linear(H, H, dtype=torch.float64)

        self.layers = nn.ModuleDict({str(i): linear() for i in range(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in sorted(self.layers, key=int):
            x = torch.tanh(self.layers[i](x))
        return x


FROZEN = ("layers.1.bias", "layers.2.weight")  # `whole_model(frozen=True)`'s: one per stage of zb-h1


def whole_model(kind: str = "plain", seed: int = 0, tie: tuple[int, ...] = (), frozen: bool = False) -> Net:
    """`Net` with seeded values; the blocks in `tie` use ``layers.0.weight`` as their weight; with
    `frozen`, the parameters `FROZEN` do not train (``requires_grad=False``)."""
    torch.manual_seed(seed)
    net = Net(kind)
    for i in tie:
        net.layers[str(i)].weight = net.layers["0"].weight
    with torch.no_grad():  # same values for every kind
        g = torch.Generator().manual_seed(seed)
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    for name in FROZEN if frozen else ():
        net.get_parameter(name).requires_grad_(False)
    return net


def all_params(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by every name (a tied one under each of its names)."""
    return dict(net.named_parameters(remove_duplicate=False))


def stage_of(whole: Net, stage: int, num_stages: int) -> Net:
    """A copy of `whole` holding only the blocks of `stage` (names unchanged)."""
    per = len(whole.layers) // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    part = copy.deepcopy(whole)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    return part


def batch(step: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, H, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, H, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference_run(kind: str, steps: int, device: Any = "cpu", accumulate: int = 1,
                  clip: float | None = None, tie: tuple[int, ...] = (),
                  frozen: bool = False) -> tuple[Net, list[dict[str, torch.Tensor]]]:
    """One process, whole model, whole batch: the model after `steps` AdamW steps and each step's
    gradients by every name, a tied weight's under each (with `accumulate`, each optimizer step sums
    the gradients of that many batches; with `clip`, torch's clip_grad_norm_ runs before each
    optimizer step, after the record; `frozen`: `whole_model`'s, whose gradients stay None)."""
    net = whole_model(kind, tie=tie, frozen=frozen).to(device)
    opt = make_optimizer(net.parameters())
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(accumulate):
            x, y = batch(step * accumulate + k, device)
            loss_fn(net(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters(remove_duplicate=False) if p.grad is not None})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return net, grads


def compare(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    fails = []
    for name, g in got.items():
        w = want[name].to(g.device)
        if not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            fails.append(f"{what} {name}: max |diff| {float((g - w).abs().max()):.3g}")
    return fails


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (collective over its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- FSDP2 x pipeline ------------------------------------------------------------------------
_MESH: dict[tuple[str, int, int], Any] = {}


def mesh(device_type: str, dp: int, pp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, dp, pp)
    if key not in _MESH:  # new_group is collective: one mesh per shape, built by every rank at once
        _MESH[key] = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return _MESH[key]


def device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def rank_stages(whole: Net, stages: list[int], num_stages: int) -> dict[int, Net]:
    """This rank's stages of one copy of `whole`: a Parameter that blocks of two of them share (a
    tie under a V placement) is one object, as when a rank splits its own model."""
    mine = copy.deepcopy(whole)
    per = len(whole.layers) // num_stages
    out = {}
    for s in stages:
        part = Net(blocks=0)
        for i in range(s * per, (s + 1) * per):
            part.layers[str(i)] = mine.layers[str(i)]
        out[s] = part
    return out


def fsdp_pipeline(schedule: str, kind: str, dp: int, pp: int, whole: Net | None = None,
                  loss: Callable[[Any, Any], torch.Tensor] = loss_fn, inner: bool = False,
                  tie: tuple[int, ...] = (), named: bool = True, noted: bool = True,
                  stale: bool = False) -> Pipeline:
    """This rank's stages of `whole` (default `whole_model(kind, tie=tie)`), each ``fully_shard``-ed
    over the dp dimension (with `inner`, each block first, as torchtitan does), in a `Pipeline` on the
    (dp, pp) mesh. With `tie` (blocks whose weight is ``layers.0.weight``) and `named`, a rank holding
    a tied block passes its copy as ``tied_parameters={"w": ...}``; a rank without stage 0 zeroes its
    copy first: construction must make it equal to stage 0's. `noted`: the stages are passed to
    `note_parameters` before ``fully_shard`` (else the pipeline finds a tie that two stages
    of the rank share by FSDP's own record alone, which torch 2.13+ keeps). `stale`: the tie is
    named by the Parameter as it was before ``fully_shard`` (as `pipeline_stages` returns it)."""
    from torch.distributed.fsdp import fully_shard

    from zbpp.runtime.fsdp import note_parameters

    dev = device_type()
    m = mesh(dev, dp, pp)
    sched = build(schedule, num_ranks=pp, num_microbatches=M)
    whole = whole if whole is not None else whole_model(kind, tie=tie)
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    pp_rank = m.get_local_rank("pp")
    stages = rank_stages(whole, sched.stages_on(pp_rank), sched.num_stages)
    held = [str(i) for i in (0, *tie) if any(str(i) in part.layers for part in stages.values())]
    if held and 0 not in stages:
        with torch.no_grad():
            next(part for part in stages.values() if held[0] in part.layers).layers[held[0]].weight.zero_()
    tied = {}
    if held and named:
        tied["w"] = next(part for part in stages.values() if held[0] in part.layers).layers[held[0]].weight
    if noted:
        note_parameters(stages)
    for s, part in stages.items():
        part.to(device)
        if inner:
            for block in part.layers.values():
                fully_shard(block, mesh=m["dp"])
        fully_shard(part, mesh=m["dp"])
    if held and named and not stale:  # the sharded copy
        tied["w"] = next(part for part in stages.values() if held[0] in part.layers).layers[held[0]].weight
    return Pipeline(stages, sched, loss_fn=loss, groups=m, tied_parameters=tied)


def my_rows(dp_rank: int, dp: int, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // dp
    return x[dp_rank * n:(dp_rank + 1) * n]


class CountReduceScatter:
    """Counts the reduce-scatters issued through torch.distributed (the FSDP collectives call
    ``dist.reduce_scatter_single`` or ``dist.reduce_scatter_tensor`` by module attribute)."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.count = 0
        self._orig: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "CountReduceScatter":
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._orig[name] = fn
                setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


TIES = {"tied": (3,), "tied023": (2, 3)}  # the blocks whose weight is layers.0.weight


def fsdp_case(case: str, dp: int = 2, pp: int = 2) -> list[str]:
    """``"<schedule>/<kind>[/option...]"``: three AdamW steps (one with accumulate: a no_sync step
    then a synchronised one) with `fsdp_pipeline`; every gradient (gathered) and the parameters
    after the steps equal `reference_run`; one reduce-scatter per stage per step. Options:
    ``accumulate``, ``clip``, ``inner``, ``tied`` / ``tied023`` (`TIES`), ``unnamed`` (the tie
    not passed as tied_parameters), ``unnoted`` (nor noted), ``stale`` (named by the Parameter
    before ``fully_shard``): `fsdp_pipeline`; ``frozen``: `FROZEN` do not train (no gradient, and
    AdamW's weight decay leaves them as they were)."""
    schedule, kind, *rest = case.split("/")
    accumulate = 2 if "accumulate" in rest else 1
    steps = 1 if accumulate > 1 else 3
    tie = next((TIES[o] for o in rest if o in TIES), ())
    frozen = "frozen" in rest
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    pipe = fsdp_pipeline(schedule, kind, dp, pp, whole_model(kind, tie=tie, frozen=frozen), inner="inner" in rest,
                         tie=tie, named="unnamed" not in rest, noted="unnoted" not in rest, stale="stale" in rest)
    dp_rank = pipe.topology.dp_rank
    # one reduce-scatter per stage and step: per FSDP module holding parameters (each block with inner)
    expected = sum(len(m.layers) if "inner" in rest else 1 for m in pipe.stage_modules.values())
    ref, ref_grads = reference_run("plain", steps, dev, accumulate, 0.05 if "clip" in rest else None, tie,
                                   frozen)  # same values, eager layers
    once = {n for n, _ in ref.named_parameters()}  # a tied weight's name once: the norm counts it once
    opt = make_optimizer(list(pipe.parameters()))
    named = {n: p for m in pipe.stage_modules.values() for n, p in m.named_parameters()}
    fails: list[str] = []
    for step in range(steps):
        opt.zero_grad()
        with CountReduceScatter() as rs:
            for k in range(accumulate):
                x, y = batch(step * accumulate + k, dev)
                x, y = my_rows(dp_rank, dp, x), my_rows(dp_rank, dp, y)
                if k < accumulate - 1:
                    with pipe.no_sync():
                        pipe.step(x, target=y)
                else:
                    pipe.step(x, target=y)
        if dp > 1 and rs.count != expected:  # (a one-rank mesh may skip the collective)
            fails.append(f"step {step}: {rs.count} reduce-scatters, {expected} expected")
        got = {n: full(p.grad) for n, p in named.items() if p.grad is not None}
        missing = sorted(set(named) - set(got) - set(FROZEN if frozen else ()))
        if missing:
            fails.append(f"step {step}: no gradient for {missing}")
        if set(got) & set(FROZEN if frozen else ()):
            fails.append(f"step {step}: frozen {sorted(set(got) & set(FROZEN))} got a gradient")
            got = {n: g for n, g in got.items() if n not in FROZEN}
        fails += compare(f"step {step} grad", got, ref_grads[step])
        if "clip" in rest:  # the norm over every stage and shard, as torch's on the whole model
            from zbpp.runtime import clip_grad_norm_

            norm = clip_grad_norm_(pipe, 0.05)
            want = torch.linalg.vector_norm(torch.cat([g.flatten() for n, g in ref_grads[step].items() if n in once]))
            if not torch.allclose(norm.to(want.device), want, rtol=RTOL, atol=ATOL):
                fails.append(f"step {step}: clip norm {float(norm)} != {float(want)}")
            coef = min(1.0, 0.05 / (float(want) + 1e-6))
            clipped = {n: full(p.grad) for n, p in named.items() if p.grad is not None}
            fails += compare(f"step {step} clipped grad", clipped, {n: g * coef for n, g in ref_grads[step].items()})
        opt.step()
    fails += compare("param", {n: full(p.detach()) for n, p in named.items()}, all_params(ref))
    x, y = batch(99, dev)
    loss = pipe.eval_step(my_rows(dp_rank, dp, x), target=my_rows(dp_rank, dp, y))
    if pipe.holds_last_stage:  # this replica's rows through the trained model
        with torch.no_grad():
            want = loss_fn(ref(my_rows(dp_rank, dp, x)), my_rows(dp_rank, dp, y))
        if not torch.allclose(loss, want, rtol=RTOL, atol=ATOL):
            fails.append(f"eval loss {float(loss)} != {float(want)}")
    return fails


def fsdp_worker(cases: list[str], dp: int = 2, pp: int = 2) -> dict[str, list[str]]:
    out = {}
    for case in cases:
        try:
            out[case] = fsdp_case(case, dp, pp)
        except Exception as exc:  # noqa: BLE001 - reported per case; the pool goes on
            import traceback

            out[case] = [f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"]
    return out


def unrecorded_tie_case() -> tuple[list[str], bool | None]:
    """zb-v, dp=2 x pp=2, ``layers.3.weight`` the Parameter of ``layers.0.weight`` (stages 0 and 3, both
    on pipeline rank 0), neither noted by `note_parameters` nor named in ``tied_parameters``: the
    warnings about FSDP's record that building the pipeline raised on this rank, and whether the two
    copies still agree after one AdamW step (None on pipeline rank 1, which holds neither)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = fsdp_pipeline("zb-v", "plain", 2, 2, tie=(3,), named=False, noted=False)
    said = [str(w.message) for w in caught if "does not record which Parameter" in str(w.message)]
    opt = make_optimizer(list(pipe.parameters()))
    x, y = batch(0)
    dp = pipe.topology.dp_rank
    pipe.step(my_rows(dp, 2, x), target=my_rows(dp, 2, y))
    opt.step()
    mods = pipe.stage_modules
    if not {0, 3} <= set(mods):
        return said, None
    a, b = full(mods[0].layers["0"].weight.detach()), full(mods[3].layers["3"].weight.detach())
    return said, torch.equal(a, b)


# -- checkpoints -----------------------------------------------------------------------------
SAVED_AFTER = 2  # steps trained before the checkpoint
RESUMED = 3  # steps after loading it


def plain_pipeline(schedule: str, pp: int, whole: Net) -> Pipeline:
    sched = build(schedule, num_ranks=pp, num_microbatches=M)
    stages = {s: stage_of(whole, s, sched.num_stages) for s in sched.stages_on(dist.get_rank())}
    return Pipeline(stages, sched, loss_fn=loss_fn)


def train(pipe: Pipeline, opt: torch.optim.Optimizer, steps: range, dp: int = 1) -> None:
    dp_rank = pipe.topology.dp_rank
    for step in steps:
        opt.zero_grad()
        x, y = batch(step)
        pipe.step(my_rows(dp_rank, dp, x), target=my_rows(dp_rank, dp, y))
        opt.step()


def params_of(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for m in pipe.stage_modules.values() for n, p in m.named_parameters()}


def save_case(path: str) -> list[str]:
    """pp=2 zb-v (2 ranks, dp=1): train `SAVED_AFTER` steps, save; the parameters equal the
    reference's at that point."""
    from zbpp.runtime import save_checkpoint

    pipe = plain_pipeline("zb-v", 2, whole_model())
    opt = make_optimizer(list(pipe.parameters()))
    train(pipe, opt, range(SAVED_AFTER))
    save_checkpoint(pipe, path, opt)
    ref, _ = reference_run("plain", SAVED_AFTER)
    return compare("saved param", params_of(pipe), dict(ref.named_parameters()))


def resume_case(path: str, layout: str) -> list[str]:
    """Load the checkpoint at `layout` (``"pp4-1f1b"``: 4 ranks, plain stages; ``"dp2-pp2-fsdp-zb-h1"``:
    fully_shard stages on a (2, 2) mesh) into a model initialised otherwise, with a fresh AdamW:
    the parameters equal the reference after `SAVED_AFTER` steps, and `RESUMED` more steps equal
    the reference after all of them (so the optimizer state came back too)."""
    from zbpp.runtime import load_checkpoint

    other = whole_model(seed=123)  # anything but the saved values
    if layout == "pp4-1f1b":
        pipe, dp = plain_pipeline("1f1b", 4, other), 1
    elif layout == "dp2-pp2-fsdp-zb-h1":
        pipe, dp = fsdp_pipeline("zb-h1", "plain", 2, 2, whole=other), 2
    else:
        raise ValueError(layout)
    opt = make_optimizer(list(pipe.parameters()))
    load_checkpoint(pipe, path, opt)
    ref, _ = reference_run("plain", SAVED_AFTER)
    fails = compare("loaded param", params_of(pipe), dict(ref.named_parameters()))
    train(pipe, opt, range(SAVED_AFTER, SAVED_AFTER + RESUMED), dp)
    ref, _ = reference_run("plain", SAVED_AFTER + RESUMED)
    fails += compare("resumed param", params_of(pipe), dict(ref.named_parameters()))
    if dp > 1:  # saved from shards, read back as one file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        from zbpp.runtime import save_checkpoint

        again = f"{path}-{layout}"
        save_checkpoint(pipe, again, opt)
        dist.barrier()
        if dist.get_rank() == 0:
            dcp_to_torch_save(again, f"{again}.pt")
            one = torch.load(f"{again}.pt")
            fails += compare("one-file param", one["model"], dict(ref.named_parameters()))
            names = sorted(n for n, _ in ref.named_parameters())
            if sorted(one["optimizer"]["state"]) != names:
                fails.append(f"optimizer state for {sorted(one['optimizer']['state'])}, want {names}")
    return fails


class StatefulSGD(torch.optim.Optimizer):
    """SGD whose per-parameter state is nothing like AdamW's: a Python int, a string, None (as SGD's
    ``momentum_buffer`` without momentum), a nested dict and a list of tensors, a 0-dim one among
    them, empty dicts (alone and in a list); and a nested hyperparameter, ``scale``, with an empty
    dict in it. Each of them changes the step or is checked by it, so a lost or restarted one shows."""

    def __init__(self, params: Any, lr: float = 0.05, factor: float = 1.0) -> None:
        super().__init__(params, {"lr": lr, "scale": {"factor": factor, "unused": {}}})  # a nested hyperparameter

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(count=0, tag="sgd", unused=None, ema={"v": torch.zeros_like(p)},
                              sums=[torch.zeros_like(p), torch.zeros((), dtype=p.dtype)], seen={}, log=[{}, 0])
                if st["tag"] != "sgd" or st["unused"] is not None:
                    raise ValueError(f"state came back as {st['tag']!r}, {st['unused']!r}")
                if st.get("seen") != {} or st.get("log") != [{}, 0] or group["scale"].get("unused") != {}:
                    raise ValueError(f"empty dicts came back as {st.get('seen')!r}, {st.get('log')!r}, "
                                     f"{group['scale'].get('unused')!r}")
                st["count"] += 1
                st["ema"]["v"].mul_(0.5).add_(p.grad)
                st["sums"][0].add_(p.grad.square())
                st["sums"][1] += 2
                lr = group["lr"] * group["scale"]["factor"]
                p.add_(st["ema"]["v"] / (st["sums"][0].sqrt() + 1), alpha=-lr / (st["count"] + float(st["sums"][1])))


class LocalStateSGD(StatefulSGD):
    """`StatefulSGD` that also keeps, per parameter, a plain tensor from this replica's own shard (the
    norms of its rows): not sharded like the parameter, so a checkpoint cannot hold every replica's."""

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["row_norms"] = (p.to_local() if hasattr(p, "to_local") else p).norm(dim=-1)


def optimizer_state_case(path: str, saved_at: str, resumed_at: str, kind: str = "stateful") -> list[str]:
    """4 ranks, `kind` ``"stateful"`` (`StatefulSGD`), ``"local-state"`` (`LocalStateSGD`) or
    ``"adafactor"`` (torch's: factored state of shapes other than its parameter's): train `SAVED_AFTER` steps at layout `saved_at`, save, load
    at `resumed_at` into a model initialised otherwise with a fresh optimizer, `RESUMED` more steps.
    Layouts: ``"fsdp-zb-v"`` / ``"fsdp-zb-h1"`` (dp=2 x pp=2, stages ``fully_shard``-ed), ``"pp4-1f1b"``
    (dp=1, plain stages). Returns what differs from the one-process run of all the steps (rtol 1e-9,
    atol 1e-11: summation order only, see the module docstring), or ``"<type>: <message>"`` of what
    a checkpoint call or a step raised."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    def build_at(layout: str, whole: Net, **hyper: float) -> tuple[Pipeline, torch.optim.Optimizer, int]:
        pipe, dp = (plain_pipeline("1f1b", 4, whole), 1) if layout == "pp4-1f1b" else \
            (fsdp_pipeline(layout.split("-", 1)[1], "plain", 2, 2, whole=whole), 2)
        params = list(pipe.parameters())
        optimizers = {"stateful": StatefulSGD, "local-state": LocalStateSGD, "adafactor": torch.optim.Adafactor}
        return pipe, optimizers[kind](params, **hyper), dp

    try:
        pipe, opt, dp = build_at(saved_at, whole_model())
        train(pipe, opt, range(SAVED_AFTER), dp)
        save_checkpoint(pipe, path, opt)
        other = {"lr": 1.0, "factor": 3.0} if kind != "adafactor" else {}  # the checkpoint's must win
        pipe, opt, dp = build_at(resumed_at, whole_model(seed=123), **other)
        load_checkpoint(pipe, path, opt)
        train(pipe, opt, range(SAVED_AFTER, SAVED_AFTER + RESUMED), dp)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return [f"{type(exc).__name__}: {exc}"]
    ref = whole_model()
    ref_opt = StatefulSGD(ref.parameters())
    for step in range(SAVED_AFTER + RESUMED):
        ref_opt.zero_grad()
        x, y = batch(step)
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    return compare("resumed param", params_of(pipe), dict(ref.named_parameters()))


# -- when the reduce-scatters run -----------------------------------------------------------------
def timing_case(schedule: str) -> list[str]:
    """zbpp delayed-wgrad stages under `schedule`: a log of every W of each stage (the modules'
    ``backward_dw``), of each stage's reduce-scatter (a custom FSDP reduce-scatter per stage) and
    of each step's return. Each stage's reduce-scatter must come after its last W of the step and
    before the step returns, once per step."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    pipe = fsdp_pipeline(schedule, "delayed", 2, 2)
    log: list[tuple[str, int]] = []

    class Logged(DefaultReduceScatter):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            log.append(("RS", self.stage))
            return super().__call__(*args, **kwargs)

    ws: dict[int, int] = {}
    for s, m in pipe.stage_modules.items():
        m.set_custom_reduce_scatter(Logged(s))
        for layer in m.modules():
            if isinstance(layer, ZLinear):
                ws[s] = ws.get(s, 0) + M
                layer.backward_dw = _logged(layer.backward_dw, log, s)
    fails = []
    for step in range(2):
        log.clear()
        x, y = batch(step)
        dp_rank = pipe.topology.dp_rank
        pipe.step(my_rows(dp_rank, 2, x), target=my_rows(dp_rank, 2, y))
        log.append(("END", -1))
        for s in pipe.stage_modules:
            at = [i for i, e in enumerate(log) if e == ("RS", s)]
            if len(at) != 1:
                fails.append(f"step {step} stage {s}: {len(at)} reduce-scatters")
                continue
            done = sum(1 for e in log[:at[0]] if e == ("W", s))
            if done != ws[s]:
                fails.append(f"step {step} stage {s}: reduce-scatter after {done} of its {ws[s]} W")
            if at[0] > log.index(("END", -1)):
                fails.append(f"step {step} stage {s}: reduce-scatter after the step returned")
    return fails


def _logged(fn: Callable[..., Any], log: list, stage: int) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        log.append(("W", stage))
        return fn(*args, **kwargs)

    return wrapped


# -- a failed step ----------------------------------------------------------------------------
def failure_case(schedule: str, microbatch: int, no_sync: bool = False, tie: tuple[int, ...] = ()) -> list[str]:
    """Global rank 1 (replica 0, last stage) raises in its loss of `microbatch` during the second
    step (inside ``no_sync()`` with `no_sync`): every rank raises PipelineError, and the run goes
    on: the failed batch again, then one more, equal three reference steps (FSDP's state was as
    the next step needs it: nothing of the failed step is left to reduce). `tie`: `fsdp_pipeline`'s."""
    from zbpp.runtime import PipelineError

    armed = {"on": False, "seen": 0}

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if armed["on"] and dist.get_rank() == 1:
            armed["seen"] += 1
            if armed["seen"] > microbatch:
                raise RuntimeError("injected")
        return loss_fn(out, y)

    pipe = fsdp_pipeline(schedule, "delayed", 2, 2, loss=loss, tie=tie)
    opt = make_optimizer(list(pipe.parameters()))
    dp_rank = pipe.topology.dp_rank
    fails = []
    for step, batch_index in enumerate([0, 1, 1, 2]):
        opt.zero_grad()
        x, y = batch(batch_index)
        armed["on"] = step == 1
        try:
            with pipe.no_sync() if (no_sync and step == 1) else contextlib.nullcontext():
                pipe.step(my_rows(dp_rank, 2, x), target=my_rows(dp_rank, 2, y))
        except PipelineError:
            if step != 1:
                raise
            continue
        if step == 1:
            fails.append("the step with the injected failure succeeded")
            continue
        opt.step()
    ref, _ = reference_run("plain", 3, tie=tie)
    named = {n: p for m in pipe.stage_modules.values() for n, p in m.named_parameters()}
    return fails + compare("param", {n: full(p.detach()) for n, p in named.items()}, all_params(ref))


# -- refused combinations --------------------------------------------------------------------
def refusal_case(what: str) -> str:
    """Build a dp=2 x pp=2 pipeline with `what` wrong; return the ValueError's message ('' if none).
    ``inner-only``: a stage not itself fully_shard-ed; ``one-call``: zb-v, the two stages of a rank
    sharded by one ``fully_shard([a, b])``; ``tied-half-sharded``: a tied copy sharded on pipeline
    rank 0 only; ``noted-partly``: zb-v, one stage of each rank noted by `note_parameters`,
    the other not; ``noted-late``: `note_parameters` after ``fully_shard``; ``graphs``:
    ``cuda_graphs=True`` (its CPU stand-in); ``noted-then-untied``: zb-v, a weight that two stages
    of rank 0 shared when noted is its own when sharded (torch 2.13+: FSDP's record tells)."""
    from torch.distributed.fsdp import fully_shard

    from zbpp.runtime.fsdp import note_parameters

    m = mesh("cpu", 2, 2)
    sched = build("zb-v" if what in ("one-call", "noted-partly", "noted-late", "noted-then-untied") else "1f1b",
                  num_ranks=2, num_microbatches=M)
    pp_rank = m.get_local_rank("pp")
    whole = whole_model("delayed", tie=(3,) if what == "noted-then-untied" else (2,))
    stages = rank_stages(whole, sched.stages_on(pp_rank), sched.num_stages)
    kwargs: dict[str, Any] = {}
    if what == "inner-only":
        fully_shard(stages[pp_rank].layers[str(2 * pp_rank)], mesh=m["dp"])
    elif what == "one-call":
        fully_shard(list(stages.values()), mesh=m["dp"])
    elif what == "tied-half-sharded":
        if pp_rank == 0:
            fully_shard(stages[0], mesh=m["dp"])
        kwargs["tied_parameters"] = {"w": stages[pp_rank].layers[str(2 * pp_rank)].weight}
    elif what == "graphs":
        for part in stages.values():
            fully_shard(part, mesh=m["dp"])
        from zbpp.runtime.task_graphs import StandInGraphs

        kwargs["cuda_graphs"] = StandInGraphs  # cuda_graphs=True's rules on the CPU
    elif what == "noted-then-untied":  # layers.3 (stage 3, rank 0) given its own weight after the note
        note_parameters(stages)
        if 3 in stages:
            stages[3].layers["3"].weight = nn.Parameter(stages[3].layers["3"].weight.detach().clone())
        for part in stages.values():
            fully_shard(part, mesh=m["dp"])
    elif what in ("noted-partly", "noted-late"):
        if what == "noted-partly":
            note_parameters({pp_rank: stages[pp_rank]})
        for part in stages.values():
            fully_shard(part, mesh=m["dp"])
        if what == "noted-late":
            try:
                note_parameters(stages)
            except ValueError as exc:
                return str(exc)
    try:
        Pipeline(stages, sched, loss_fn=loss_fn, groups=m, **kwargs)
    except (ValueError, PipelineError) as exc:  # PipelineError: on the ranks told of another's error
        return str(exc)
    return ""


# -- a checkpoint call wrong on one rank -----------------------------------------------------
def one_rank_wrong_case(path: str, when: str) -> str:
    """2 ranks, rank r holding stage r of `Net` (a ``{stage: module}`` mapping, no Pipeline); rank 1
    alone is wrong: ``"save"``/``"load"``: its optimizer holds a Parameter no stage of it holds
    (raised before DCP's collective); ``"apply"``: the checkpoint saved ``weight_decay`` 0.1 for
    weights and 0 for biases, and rank 1 loads into one group holding both (raised after reading the
    hyperparameters, before the tensors).
    Returns ``"<seconds>s <type>: <message>"`` of what `save_checkpoint`/`load_checkpoint` raised on
    this rank, or ``"<seconds>s ok"``."""
    from zbpp.runtime import save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    net = stage[rank]
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    grouped = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    stranger = [nn.Parameter(torch.zeros(3))] if rank == 1 and when in ("save", "load") else []
    if when != "save":  # a right checkpoint to load from
        save_checkpoint(stage, path, torch.optim.AdamW(grouped))
        dist.barrier()
    if rank == 1 and when == "apply":
        opt = torch.optim.AdamW(list(net.parameters()))
    else:
        opt = torch.optim.AdamW([*grouped, *([{"params": stranger}] if stranger else [])])
    return _timed_checkpoint_call(when, stage, path, opt, Exception)


def colliding_names_case(path: str) -> list[str]:
    """2 ranks, rank r holding stage r as an ``nn.Sequential`` of its own (every stage's Linear named
    ``0.weight``), each with a constant buffer ``scale`` alike on both. DCP kept one ``0.weight`` for
    both, so the load gave each stage the same weights (stage 1's): the save must raise on both
    ranks, naming the name, and write nothing. Stages named as in the whole model save and load
    their own values (exact: a copy). Returns what went wrong on this rank."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = nn.Sequential(nn.Linear(3, 3))
    stage.register_buffer("scale", torch.full((2,), 0.5))
    fails = []
    try:
        save_checkpoint({rank: stage}, path)
        fails.append("stages holding different tensors under one name were saved")
    except ValueError as exc:
        if "different tensors named '0." not in str(exc) or "nothing was saved" not in str(exc):
            fails.append(f"message: {exc}")
    dist.barrier()
    if os.path.exists(os.path.join(path, ".metadata")):
        fails.append("the refused save wrote a checkpoint")
    named = nn.Sequential(*[nn.Identity()] * rank, stage[0])  # "0.weight" on stage 0, "1.weight" on stage 1
    named.register_buffer("scale", torch.full((2,), 0.5))
    save_checkpoint({rank: named}, path)
    fresh = nn.Sequential(*[nn.Identity()] * rank, nn.Linear(3, 3))
    fresh.register_buffer("scale", torch.zeros(2))
    load_checkpoint({rank: fresh}, path)
    for (n, a), b in zip(named.state_dict().items(), fresh.state_dict().values()):
        if not torch.equal(a, b):
            fails.append(f"{n} loaded {b.tolist()}, saved {a.tolist()}")
    return fails


def failed_overwrite_case(path: str) -> str:
    """2 ranks, rank r holding stage r of `Net`: save the initial values into `path`, then save
    other values into the same `path` while rank 1's write fails (a full disk: DCP raises on both
    ranks, after rank 0 wrote its file), then load `path` into fresh stages. Returns
    ``"<type>: <message>"`` of what the load raised on this rank, or what it loaded: ``"loaded the
    first save"``, ``"loaded the second save"`` or ``"loaded a mix"`` (of the ranks' stages)."""
    import torch.distributed.checkpoint as dcp

    from zbpp.runtime import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    first, second = whole_model(seed=1), whole_model(seed=2)
    save_checkpoint({rank: stage_of(first, rank, 2)}, path)
    dist.barrier()
    write = dcp.FileSystemWriter.write_data

    def full_disk(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    dcp.FileSystemWriter.write_data = full_disk if rank == 1 else write  # type: ignore[method-assign]
    try:
        save_checkpoint({rank: stage_of(second, rank, 2)}, path)
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException, expected on both ranks
        pass
    finally:
        dcp.FileSystemWriter.write_data = write  # type: ignore[method-assign]
    dist.barrier()
    fresh = stage_of(whole_model(seed=3), rank, 2)
    try:
        load_checkpoint({rank: fresh}, path)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    got = torch.tensor([float(torch.equal(fresh.state_dict()[n], t)) for n, t in stage_of(second, rank, 2).state_dict().items()]).all()
    both = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(both, got.float().reshape(1))
    return {(1.0, 1.0): "loaded the second save", (0.0, 0.0): "loaded the first save"}.get(
        (float(both[0]), float(both[1])), "loaded a mix")


def failed_load_case(path: str, how: str) -> str:
    """2 ranks, rank r holding stage r of `Net` and an AdamW over it: a step, a save, another step,
    then a load of the checkpoint that fails: ``"future"``: saved as format version 2 (a later
    zbpp's); ``"unreadable"``: an AdamW moment in rank 1's data file overwritten with zeros after
    the save (the file's size stays: the read fails part-way, after rank 1 read its weights and
    rank 0 all of its own); ``"device-oom"``: rank 1's live AdamW moments are float32 (so the
    load makes new float64 ones on the device) and its move of the second one onto the device
    raises ``torch.OutOfMemoryError``. Returns ``"<type>: <message>"`` of what the load raised on this rank (``"ok"`` if
    nothing), then ``"; changed: <what>"`` for each model entry or optimizer state that is not as
    before the load."""
    import copy

    from zbpp.runtime import checkpoint, load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    opt = torch.optim.AdamW(stage[rank].parameters(), lr=0.1)

    def step(i: int) -> None:
        opt.zero_grad()
        stage[rank](batch(i)[0]).square().mean().backward()
        opt.step()

    step(0)
    version = getattr(checkpoint, "_FORMAT_VERSION", 1)
    checkpoint._FORMAT_VERSION = 2 if how == "future" else version  # type: ignore[attr-defined]
    try:
        save_checkpoint(stage, path, opt)
    finally:
        checkpoint._FORMAT_VERSION = version  # type: ignore[attr-defined]
    if how == "unreadable" and rank == 1:  # zeros over rank 1's last AdamW moment: read after its weights
        import torch.distributed.checkpoint as dcp

        where = dcp.FileSystemReader(path).read_metadata().storage_data
        index = max((i for i in where if i.fqn.startswith("optimizer.state.") and i.fqn.endswith(".exp_avg_sq")
                     and where[i].relative_path.startswith("__1_")), key=lambda i: where[i].offset)
        with open(os.path.join(path, where[index].relative_path), "r+b") as f:
            f.seek(where[index].offset)
            f.write(bytes(where[index].length))
    dist.barrier()
    step(1)
    oom = how == "device-oom" and rank == 1
    if oom:  # moments of another dtype than the saved ones: the load replaces them with new tensors
        for state in opt.state.values():
            state.update({k: v.float() for k, v in state.items() if k != "step"})
    model_before = {k: v.clone() for k, v in stage[rank].state_dict().items()}
    opt_before = copy.deepcopy(opt.state_dict())
    try:
        with _out_of_memory_on_second_move() if oom else contextlib.nullcontext():
            load_checkpoint(stage, path, opt)
        got = "ok"
    except BaseException as exc:  # noqa: BLE001 - the test reads the type and the message (DCP's is no Exception)
        got = f"{type(exc).__name__}: {exc}"
    changed = [k for k, v in stage[rank].state_dict().items() if not torch.equal(v, model_before[k])]
    opt_after = opt.state_dict()
    changed += [f"optimizer state[{i}][{k!r}]" for i, s in opt_before["state"].items() for k, v in s.items()
                if k not in opt_after["state"].get(i, {}) or not torch.equal(opt_after["state"][i][k], v)
                or opt_after["state"][i][k].dtype != v.dtype]
    changed += ["optimizer param_groups"] if opt_after["param_groups"] != opt_before["param_groups"] else []
    return got + (f"; changed: {', '.join(changed)}" if changed else "")


@contextlib.contextmanager
def _out_of_memory_on_second_move() -> Iterator[None]:
    """``Tensor.to`` raises ``torch.OutOfMemoryError`` on its second call from `load_checkpoint`'s
    move of optimizer state onto the device (``checkpoint._placed``), as a GPU out of memory would."""
    to, calls = torch.Tensor.to, []

    def failing_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_code.co_name == "_placed":
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("simulated: out of memory moving optimizer state")
        return to(self, *args, **kwargs)

    torch.Tensor.to = failing_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.to = to  # type: ignore[method-assign]
    assert len(calls) >= 2, "the load made no second move (the test proves nothing)"


def scheduler_case(path: str, what: str = "lr_scheduler") -> str:
    """2 ranks, rank r holding stage r of `Net`; an AdamW of lr 0.1 (one group) with a LambdaLR, 3 steps on
    rank 0 and 4 on rank 1. Save with lr_scheduler=, load into a fresh optimizer
    and scheduler, step once more: the learning rate must be the uninterrupted run's. Returns what
    went wrong on this rank ('' if nothing), or ``"<type>: <message>"`` of what a call raised.
    `what` ``"grad_scaler"``: save with a GradScaler of scale 2**16 on rank 0, 2**10 on rank 1 instead."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    if what == "grad_scaler":
        try:
            save_checkpoint(stage, path, grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** (16 - 6 * rank)))
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            return f"{type(exc).__name__}: {exc}"
        return "saved"

    def schedule() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(stage[rank].parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)

    opt, sched = schedule()
    for _ in range(3 + rank):
        opt.step()
        sched.step()
    try:
        save_checkpoint(stage, path, opt, lr_scheduler=sched)
        opt2, sched2 = schedule()
        load_checkpoint(stage, path, opt2, lr_scheduler=sched2)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(exc).__name__}: {exc}"
    sched.step()  # the uninterrupted run
    sched2.step()
    return "" if sched2.get_last_lr() == sched.get_last_lr() else \
        f"resumed lr {sched2.get_last_lr()}, uninterrupted {sched.get_last_lr()}"


def layerwise_lr(block: int) -> float:
    """The learning rate of block `block` of `Net` under layer-wise decay: 0.1, halved per block down from the last."""
    return 0.1 * 0.5 ** (3 - block)


def layerwise_schedule(net: Net) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with one group per block `net` holds, at its `layerwise_lr`, and a LambdaLR (lr x 0.8**step)."""
    opt = torch.optim.AdamW([{"params": list(net.layers[i].parameters()), "lr": layerwise_lr(int(i))}
                             for i in sorted(net.layers, key=int)])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)


def layerwise_scheduler_case(path: str) -> dict[int, float]:
    """2 ranks, rank r holding stage r of `Net` with `layerwise_schedule` (the ranks' schedulers hold
    different base_lrs: their own groups'); 2 steps, saved; a fresh optimizer and scheduler at the same
    layout loaded and stepped twice more. Returns {block: lr} of this rank's groups after."""
    from zbpp.runtime import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    opt, sched = layerwise_schedule(stage[rank])
    for _ in range(2):
        opt.step()
        sched.step()
    save_checkpoint(stage, path, opt, lr_scheduler=sched)
    fresh = stage_of(whole_model(seed=3), rank, 2)
    opt, sched = layerwise_schedule(fresh)
    load_checkpoint({rank: fresh}, path, opt, lr_scheduler=sched)
    for _ in range(2):
        opt.step()
        sched.step()
    blocks = sorted(stage[rank].layers, key=int)
    return {int(b): lr for b, lr in zip(blocks, sched.get_last_lr())}


def mixed_precision_case(schedule: str, kind: str) -> list[str]:
    """dp=2 x pp=2, float64 stages ``fully_shard``-ed with ``MixedPrecisionPolicy(param_dtype=float32,
    reduce_dtype=float64)``: two steps' gathered float64 gradients equal one process running a float32
    copy of the whole model on the whole batch (gradients summed in float64). Tolerance rtol 1e-5,
    atol 1e-6: float32 forwards and backwards summed in another order (microbatches, replicas) agree
    to a few float32 ulps (~1e-7); a lost or doubled microbatch is 1/4 of a gradient. (``fused``:
    gradients folded from ``main_grad`` beside FSDP's float64 accumulation once broke its
    reduce-scatter: "expects uniform gradient dtype".)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = mesh(device_type(), 2, 2)
    sched = build(schedule, num_ranks=2, num_microbatches=M)
    stages = rank_stages(whole_model(kind), sched.stages_on(m.get_local_rank("pp")), sched.num_stages)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    for st in stages.values():
        fully_shard(st, mesh=m["dp"], mp_policy=policy)

    def loss64(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.double(), y)

    pipe = Pipeline(stages, sched, loss_fn=loss64, groups=m)
    ref = whole_model("plain").float()
    grads: dict[str, torch.Tensor] = {}
    for step in range(2):  # without zeroing: the second step adds to the first
        x, y = batch(step)
        pipe.step(my_rows(pipe.topology.dp_rank, 2, x), target=my_rows(pipe.topology.dp_rank, 2, y))
        ref.zero_grad()
        loss64(ref(x.float()), y).backward()
        for n, p in ref.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad.double()
    fails = []
    for st in stages.values():
        for n, p in st.named_parameters():
            got = full(p.grad)
            if got.dtype != torch.float64:
                fails.append(f"{n}: a {got.dtype} gradient for a float64 parameter")
            elif not torch.allclose(got, grads[n], rtol=1e-5, atol=1e-6):
                fails.append(f"{schedule}/{kind} {n}: max |diff| {float((got - grads[n]).abs().max()):.3g}")
    return fails


def fused_bf16_case(schedule: str) -> list[str]:
    """dp=2 x pp=2, each stage one fused delayed zbpp Linear (identity weight, float32 shards)
    ``fully_shard``-ed with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
    each replica's microbatches are one row each: c, c * 2**-8, 0, 0 (c = replica + 1, times the
    column + 1). A weight's gradient is 1/4 of the sum of its rows: in float32 the second row adds
    c * 2**-8, which bfloat16 (8 significant bits) rounds away or up. The gathered float32 gradient
    must equal one process's float32 accumulation of the 8 rows (every value here is exact in
    float32: rtol 1e-6 for the order of the sums; the bfloat16 rounding is ~2**-9 relative). (The
    float32 main_grad was cast to bfloat16 before FSDP's float32 reduce-scatter.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = mesh(device_type(), 2, 2)
    sched = build(schedule, num_ranks=2, num_microbatches=M)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages = {}
    for s in sched.stages_on(m.get_local_rank("pp")):
        stages[s] = ZLinear(H, H, bias=False, delay_wgrad_compute=True, params_dtype=torch.float32,
                            fuse_wgrad_accumulation=True)
        with torch.no_grad():
            stages[s].weight.copy_(torch.eye(H))
        fully_shard(stages[s], mesh=m["dp"], mp_policy=policy)
    pipe = Pipeline(stages, sched, loss_fn=lambda out, y: out.float().sum(), groups=m)
    cols = torch.arange(1, H + 1, dtype=torch.float32)
    x = torch.stack([c * cols for d in range(2) for c in (d + 1.0, (d + 1.0) * 2**-8, 0.0, 0.0)])
    pipe.step(my_rows(pipe.topology.dp_rank, 2, x), target=my_rows(pipe.topology.dp_rank, 2, x))
    ref = nn.Sequential(*(nn.Linear(H, H, bias=False) for _ in range(sched.num_stages)))
    with torch.no_grad():
        for lin in ref:
            lin.weight.copy_(torch.eye(H))
    for row in x:  # one process: every microbatch of both replicas, the mean of the 8, float32 .grad
        (ref(row[None]).sum() / (M * 2)).backward()
    fails = []
    for s, st in stages.items():
        got, want = full(st.weight.grad), ref[s].weight.grad
        if got.dtype != torch.float32 or not torch.allclose(got, want, rtol=1e-6, atol=0.0):
            fails.append(f"{schedule} stage {s}: {got.dtype} gradient, max |diff| "
                         f"{float((got.float() - want).abs().max()):.3g} (one process: {want[0].tolist()})")
    return fails


class _Branches(nn.Module):
    """Stage `s` of `unused_on_one_replica_case`: a Linear and tanh, plus ``some`` on rows whose
    first column is above 50 (only replica 1's data) and ``never`` on rows above 1e6 (none)."""

    def __init__(self, s: int) -> None:
        super().__init__()
        torch.manual_seed(300 + s)
        self.lin = nn.Linear(H, H, dtype=torch.float64)
        self.some = nn.Linear(H, H, dtype=torch.float64)
        self.never = nn.Linear(H, H, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(x))
        if bool(x[:, 0].max() > 50):
            out = out + 0.1 * torch.tanh(self.some(x))
        if bool(x[:, 0].max() > 1e6):
            out = out + self.never(x)
        return out


def unused_on_one_replica_case(schedule: str) -> list[str]:
    """dp=2 x pp=2, ``fully_shard`` stages with a branch that only replica 1's data takes (as an
    expert that only some replicas route tokens to) and one that none takes: after a synchronised
    step, and after a no_sync step and a synchronised one, each gathered gradient is the replicas'
    average of one process's per-replica gradients (replica 0 adding nothing to the branch's),
    None where no replica has one. (FSDP reduce-scatters only the parameters with a gradient, so
    the replicas' reduce-scatters once differed in size: gloo aborted the processes.)"""
    from torch.distributed.fsdp import fully_shard

    m = mesh(device_type(), 2, 2)
    sched = build(schedule, num_ranks=2, num_microbatches=M)
    ref = [_Branches(s) for s in range(sched.num_stages)]
    stages = {s: copy.deepcopy(ref[s]) for s in sched.stages_on(m.get_local_rank("pp"))}
    for st in stages.values():
        fully_shard(st, mesh=m["dp"])
    pipe = Pipeline(stages, sched, loss_fn=loss_fn, groups=m)
    fails = []
    for step in range(3):
        x, y = batch(step)
        x[ROWS // 2:, 0] += 100.0  # replica 1's rows take the branch, at every stage
        with pipe.no_sync() if step == 1 else contextlib.nullcontext():
            pipe.step(my_rows(pipe.topology.dp_rank, 2, x), target=my_rows(pipe.topology.dp_rank, 2, y))
        for d in range(2):  # the replicas' average
            h = my_rows(d, 2, x)
            for st in ref:
                h = st(h)
            (loss_fn(h, my_rows(d, 2, y)) / 2).backward()
        if step == 1:
            continue
        for s, st in stages.items():
            for n, p in st.named_parameters():
                want = ref[s].get_parameter(n).grad
                got = None if p.grad is None else full(p.grad)
                if got is None or want is None:
                    if got is not want:
                        fails.append(f"step {step} stage {s} {n}: got {'None' if got is None else 'a gradient'}, "
                                     f"one process {'None' if want is None else 'a gradient'}")
                elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                    fails.append(f"step {step} stage {s} {n}: max |diff| {float((got - want).abs().max()):.3g}")
    return fails


class _Scaled(nn.Module):
    """Stage `s` of `clip_one_row_case`: a Linear, tanh, times a one-element Parameter, which
    ``fully_shard`` over 2 replicas leaves empty on replica 1."""

    def __init__(self, s: int) -> None:
        super().__init__()
        torch.manual_seed(200 + s)
        self.lin = nn.Linear(H, H, dtype=torch.float64)
        self.scale = nn.Parameter(torch.full((1,), 1.0 + 0.5 * s, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


def clip_one_row_case() -> list[str]:
    """dp=2 x pp=2 (1f1b), ``fully_shard`` stages holding a one-element Parameter (replica 1's
    shard of it is empty): `clip_grad_norm_` with the inf-norm, then the 2-norm, gives torch's norm
    and clipped gradients of one process on the whole model and batch. (The inf-norm of the empty
    shard once raised on replica 1 alone, leaving replica 0 in the all-reduce.)"""
    import math

    from torch.distributed.fsdp import fully_shard

    from zbpp.runtime import clip_grad_norm_

    m = mesh(device_type(), 2, 2)
    sched = build("1f1b", num_ranks=2, num_microbatches=M)
    ref = [_Scaled(s) for s in range(2)]
    stages = {s: copy.deepcopy(ref[s]) for s in sched.stages_on(m.get_local_rank("pp"))}
    for st in stages.values():
        fully_shard(st, mesh=m["dp"])
    pipe = Pipeline(stages, sched, loss_fn=loss_fn, groups=m)
    dp_rank = pipe.topology.dp_rank
    x, y = batch(0)
    pipe.step(my_rows(dp_rank, 2, x), target=my_rows(dp_rank, 2, y))
    loss_fn(ref[1](ref[0](x)), y).backward()
    fails = []
    for norm_type in (math.inf, 2.0):  # the second clips what the first left
        want = torch.nn.utils.clip_grad_norm_([p for r in ref for p in r.parameters()], 0.01, norm_type=norm_type)
        got = clip_grad_norm_(pipe, 0.01, norm_type=norm_type)
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            fails.append(f"{norm_type}-norm {float(got)}, torch in one process: {float(want)}")
        fails += compare(f"after clipping by the {norm_type}-norm",
                         {n: full(p.grad) for s, st in stages.items() for n, p in st.named_parameters()},
                         {n: p.grad for s in stages for n, p in ref[s].named_parameters()})
    return fails


def tie_drift_case(schedule: str) -> list[str]:
    """dp=2 x pp=2, ``layers.0.weight`` tied to ``layers.3``, every stage ``fully_shard``-ed: under
    zb-h1 the copies sit on two ranks of each pipeline (their shards compared within the pipeline),
    under zb-v on one rank, split into a copy per stage by FSDP (compared on that rank). After a
    step `Pipeline.check_ties` passes; then global rank 3 (zb-h1: stage 1 of replica 1) or 2 (zb-v:
    stage 3 of replica 1) adds 1e-3 to one element of its shard of the layers.3 copy, and it raises.
    Returns what each call did: ``"ok"`` or ``"<type>: <message>"``."""
    pipe = fsdp_pipeline(schedule, "plain", 2, 2, tie=(3,))
    x, y = batch(0)
    pipe.step(my_rows(pipe.topology.dp_rank, 2, x), target=my_rows(pipe.topology.dp_rank, 2, y))
    out = []
    for changed in (False, True):
        if changed and dist.get_rank() == (3 if schedule == "zb-h1" else 2):
            copy = next(m.layers["3"].weight for m in pipe.stage_modules.values() if "3" in m.layers)
            with torch.no_grad():
                copy.to_local().view(-1)[0] += 1e-3
        try:
            pipe.check_ties()
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def changed_after_build_case() -> list[str]:
    """dp=2 x pp=2 zb-h1, delayed layers, every stage ``fully_shard``-ed. A forward of every stage
    outside the steps leaves FSDP's unsharded parameters in the modules: the next step still trains
    (its gradients those of `reference_run`). Then ``layers.2.bias`` (stage 1) is replaced by a new
    Parameter, which FSDP neither shards nor reduces: every rank refuses the step. Returns the
    gradient mismatches, then the refusal's message ('' if none)."""
    pipe = fsdp_pipeline("zb-h1", "delayed", 2, 2)
    dp_rank = pipe.topology.dp_rank
    x, y = batch(0)
    with torch.no_grad():  # a look at the stages' outputs between steps
        for m in pipe.stage_modules.values():
            m(x[:, :H])
    pipe.step(my_rows(dp_rank, 2, x), target=my_rows(dp_rank, 2, y))
    _, grads = reference_run("plain", 1)
    fails = compare("after a forward outside", {n: full(p.grad) for m in pipe.stage_modules.values()
                                                for n, p in m.named_parameters()}, grads[0])
    for m in pipe.stage_modules.values():
        if "2" in m.layers:
            m.layers["2"].bias = nn.Parameter(torch.zeros(H, dtype=torch.float64))
    try:
        pipe.step(my_rows(dp_rank, 2, x), target=my_rows(dp_rank, 2, y))
    except (ValueError, PipelineError) as exc:  # PipelineError: the ranks told of another rank's error
        return [*fails, str(exc)]
    return [*fails, ""]


def interrupted_checkpoint_case(path: str, when: str) -> str:
    """2 ranks, rank r holding stage r of `Net`; on rank 1 a KeyboardInterrupt comes while
    `save_checkpoint` (``"save"``) or `load_checkpoint` (``"load"``) reads its stage's state_dict.
    Returns ``"<seconds>s <type>: <message>"`` of what the call raised on this rank, or ``"<seconds>s ok"``."""
    from zbpp.runtime import save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    opt = torch.optim.AdamW(list(stage[rank].parameters()))
    if when == "load":  # a right checkpoint to load from
        save_checkpoint(stage, path, opt)
        dist.barrier()
    if rank == 1:
        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt("Ctrl-C on rank 1")

        stage[rank].state_dict = interrupted  # type: ignore[method-assign]
    return _timed_checkpoint_call(when, stage, path, opt, BaseException)


def ctrl_c_while_saving_case(path: str) -> str:
    """2 ranks, rank r holding stage r of `Net`; rank 0 comes to `save_checkpoint` a second late, and
    rank 1, waiting for it in the save's exchange, gets a real SIGINT (Ctrl-C). Returns
    ``"<type>: <message>"`` of what the save raised on this rank (or ``"ok"``); then every rank
    changes its parameters and loads the checkpoint back, which must give the values saved."""
    import os
    import signal
    import threading
    import time

    import torch.distributed.checkpoint  # noqa: F401 - imported now: the SIGINT must come in the exchange

    from zbpp.runtime import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    stage = {rank: stage_of(whole_model(), rank, 2)}
    saved = {k: v.clone() for k, v in stage[rank].state_dict().items()}
    if rank == 0:
        time.sleep(1.0)  # rank 1 waits for it in the save's exchange
    else:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        save_checkpoint(stage, path)
        got = "ok"
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the test reads the type and the message
        got = f"{type(exc).__name__}: {exc}"
    time.sleep(0.5)  # no SIGINT still on its way into the load
    with torch.no_grad():
        for q in stage[rank].parameters():
            q.add_(1.0)
    load_checkpoint(stage, path)
    for k, v in stage[rank].state_dict().items():
        assert torch.equal(v, saved[k]), f"rank {rank}: {k} differs from the saved value after loading"
    return got


def _timed_checkpoint_call(when: str, stage: Any, path: str, opt: Any, caught: type[BaseException]) -> str:
    """``save_checkpoint`` (`when` "save") or ``load_checkpoint`` of `stage`, timed: ``"<s>s ok"``,
    or ``"<s>s <type>: <message>"`` of what it raised (`caught` and its subclasses)."""
    import time

    from zbpp.runtime import load_checkpoint, save_checkpoint

    start = time.monotonic()
    try:
        (save_checkpoint if when == "save" else load_checkpoint)(stage, path, opt)
    except caught as exc:  # noqa: BLE001 - the test reads the type and the message
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    return f"{time.monotonic() - start:.1f}s ok"


def host_staging_case(path: str) -> list[str]:
    """2 ranks, dp=2: ``nn.Linear(H, 5)`` (float64) and its AdamW state after a step, saved by rank 0
    alone, loaded into a ``fully_shard`` copy of it (another seed) whose weights split unevenly (5
    rows: shards of 3 and 2) and whose optimizer holds state for the weight only (zeros: DTensors
    like it). What `load_checkpoint` reads into (`_state_to_load`) must be plain host tensors of this
    rank's shard (0-dim for ``step``), not DTensors on the stage's device; then the weight's live
    state DTensors hold the loaded values in place (the same objects), the bias's state is new
    DTensors sharded like it, and every whole tensor equals the saved one (``torch.equal``: copies).
    Returns what is wrong ([] if nothing)."""
    from torch.distributed.fsdp import fully_shard

    from zbpp.runtime import checkpoint, load_checkpoint, save_checkpoint

    saved = nn.Linear(H, 5, dtype=torch.float64)
    with torch.no_grad():
        saved.weight.copy_(torch.arange(5 * H, dtype=torch.float64).reshape(5, H))
        saved.bias.copy_(torch.arange(5, dtype=torch.float64))
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
    saved(torch.ones(2, H, dtype=torch.float64)).square().sum().backward()
    saved_opt.step()
    alone = dist.new_group([0])  # collective: every rank builds it
    if dist.get_rank() == 0:
        save_checkpoint(saved, path, saved_opt, process_group=alone)
    dist.barrier()
    net = nn.Linear(H, 5, dtype=torch.float64)
    fully_shard(net, mesh=mesh("cpu", 2, 1)["dp"])
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    opt.state[net.weight] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros_like(net.weight),
                             "exp_avg_sq": torch.zeros_like(net.weight)}
    before = dict(opt.state[net.weight])
    fails = []
    loading = checkpoint._state_to_load(net, path, opt, None)
    for name, value in loading.model_state.items():
        local = net.state_dict()[name].to_local()
        if hasattr(value, "placements") or value.device.type != "cpu" or value.shape != local.shape:
            fails.append(f"{name} staged as {type(value).__name__} {tuple(value.shape)} on {value.device}, "
                         f"not a host tensor of the local shard's shape {tuple(local.shape)}")
    for name, fields in loading.state["optimizer"]["state"].items():
        local = net.get_parameter(name).to_local()
        for field, value in fields.items():
            shape = local.shape if field != "step" else torch.Size([])
            if hasattr(value, "placements") or value.device.type != "cpu" or value.shape != shape:
                fails.append(f"optimizer state {name}.{field} staged as {type(value).__name__} {tuple(value.shape)} "
                             f"on {value.device}, not a host tensor of shape {tuple(shape)}")
    load_checkpoint(net, path, opt)
    for name, value in saved.state_dict().items():
        if not torch.equal(net.state_dict()[name].full_tensor(), value):
            fails.append(f"{name} loaded wrong")
    for name, p in net.named_parameters():
        want = saved_opt.state[saved.get_parameter(name)]
        if opt.state[p].keys() != want.keys():
            fails.append(f"{name}: optimizer state {sorted(opt.state[p])}, saved {sorted(want)}")
        for field, value in opt.state[p].items():
            if field != "step" and getattr(value, "placements", None) != p.placements:
                fails.append(f"{name}.{field} loaded as {type(value).__name__}, not sharded like its parameter")
            whole = value.full_tensor() if hasattr(value, "placements") else value
            if not torch.equal(whole, want[field]):
                fails.append(f"{name}.{field} loaded wrong: {whole} != {want[field]}")
            if name == "weight" and value is not before[field]:
                fails.append(f"{name}.{field}: the live tensor was replaced, not loaded into in place")
    return fails
