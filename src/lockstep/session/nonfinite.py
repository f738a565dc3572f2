"""The non-finite loss policy: the per-step gradient check, naming the ranks, one decision on every rank.

The decision is made before the optimizer steps and is final: a step is taken or skipped, never
reported as taken and taken back later. CPU gradients' flags are read from memory (no tensor op);
on an accelerator the flags of every group are folded on the device and read once per step (one
host sync, as ``GradScaler.step`` costs). The policy counts nothing: the session's ``TrainState`` does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.errors import LockstepError, format_ranks
from lockstep.precision.torch_amp import check_and_unscale_

__all__ = [
    "FiniteCheck",
    "NonFinitePolicy",
    "NonFiniteLossError",
    "NONFINITE_POLICIES",
    "name_nonfinite_ranks",
]

NONFINITE_POLICIES = ("skip", "stop", "ignore")


class NonFiniteLossError(LockstepError):
    """The loss became NaN or infinite and the session was told to stop (``nonfinite="stop"``), or it was
    non-finite ``MAX_SKIPS_IN_A_ROW`` (20) steps in a row under ``"skip"``: the run diverged. Raised on
    every rank; ``lockstep train`` and ``lockstep run`` exit with code 1 (``EXIT_FAILURE``)."""


class NonFinitePolicy:
    """What a session does when the loss turns NaN/inf on any rank; every rank decides alike.

    Args:
        policy: ``"skip"``, ``"stop"`` or ``"ignore"``.
        comm: the job's collectives (to name the ranks, and to agree on sharded gradients); one process's
            ``Comm`` where there is no job.
    """

    def __init__(self, policy: str, comm: Comm) -> None:
        self.policy = policy
        self.active = policy != "ignore"
        self.loss: torch.Tensor | None = None
        self.comm = comm
        self.check = FiniteCheck(comm)

    def record(self, loss: torch.Tensor) -> None:
        """Keep this micro-step's loss, to tell which ranks saw a non-finite one.

        The tensor itself, not a detached copy (a tensor op each step): after backward its graph holds
        no saved tensors, and the loop's own ``loss`` variable keeps the same until the next step.
        """
        if self.active:
            self.loss = loss

    def gradients_finite(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | None = None) -> bool:
        """Whether the step goes ahead: every gradient ``optimizer`` applies is finite, or the policy is ``"ignore"``.

        ``inv_scale``: a loss scale's inverse, multiplied into the gradients by the same kernel; they are then
        always checked (an overflow must back the scale off whatever the policy).
        The same answer on every rank, and final: the caller skips the step when it is False.
        """
        if inv_scale is None and not self.active:
            return True
        return self.check(optimizer, inv_scale)

    def skip_message(self, step: int, epoch: int) -> str:
        """The warning for a step skipped on every rank (it names the ranks: every rank must call it).

        Raises:
            NonFiniteLossError: under ``"stop"``.
        """
        ranks = name_nonfinite_ranks(self.comm, self.loss)
        text = f"non-finite loss on {format_ranks(ranks) if ranks else 'a rank'} at step {step} (epoch {epoch})"
        if self.policy == "stop":
            raise NonFiniteLossError(f"{text}; stopping every rank (nonfinite='stop')")
        return f"lockstep: warning: {text}; the step was skipped on every rank"


class FiniteCheck:
    """Whether every gradient an optimizer is about to apply is finite.

    Runs GradScaler's fused kernel (unscaling by 1) per device and dtype, on the optimizer's
    parameters (so every model a session set up is covered); the grouping and flags are kept between steps.

    Args:
        comm: the job's collectives: sharded gradients' ranks agree on one flag over it.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        # id(optimizer) -> (a weak reference to it, its plan): a dict read per step, the entry dropped with it
        self._plans: dict[int, tuple[weakref.ref[Any], _Plan]] = {}

    def plan(self, optimizer: torch.optim.Optimizer) -> _Plan:
        """The check's plan for ``optimizer``, remade when its groups change size."""
        entry = self._plans.get(id(optimizer))
        if entry is not None and entry[0]() is optimizer and entry[1].fits(optimizer.param_groups):
            return entry[1]
        # every parameter, frozen ones too: one unfrozen later has its gradient checked
        param_groups = optimizer.param_groups
        size = [len(g["params"]) for g in param_groups]
        plan = _Plan(size, [p for g in param_groups for p in g["params"]], self.comm)
        key = id(optimizer)
        self._plans[key] = (weakref.ref(optimizer, lambda _: self._plans.pop(key, None)), plan)
        return plan

    def __call__(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | None = None) -> bool:
        """True when every gradient of ``optimizer``'s parameters is finite (``None`` ones are skipped).

        ``inv_scale``: multiply the gradients by it in the same kernel (unscale a loss-scaled step).
        """
        plan = self.plan(optimizer)
        checked = plan.run(inv_scale)
        if plan.in_place:  # most CPU jobs: each flag's memory read in place, no tensor op
            finite = True
            for group in checked:
                if group.host[0]:  # type: ignore[index]
                    group.flag.zero_()  # the kernel only ever sets a flag: clear it for the next step
                    finite = False
            return finite
        if plan.agree is not None:
            # a shard holds only its part of each gradient: a non-finite element is seen by the
            # rank that owns it alone, so the ranks agree on the flag (one small all_reduce)
            total = torch.zeros(1, device=plan.groups[0].flag.device)
            for group in checked:
                total += group.flag.to(total.device)
            bad = bool(plan.agree.all_reduce(total, "max").item())
        elif not checked:
            return True
        else:
            total = checked[0].flag
            for group in checked[1:]:
                total = total + group.flag.to(total.device)
            bad = bool(total.item())  # one host sync
        if bad:
            for group in checked:
                group.flag.zero_()  # the kernel only ever sets a flag: clear it for the next step
        return not bad


class _Plan:
    """What one optimizer's check needs: groups, where the flags are read, the comm for sharded parameters."""

    def __init__(self, size: list[int], params: list[torch.Tensor], comm: Comm) -> None:
        self.size = size
        self.groups = _plan(params)
        sharded = any(g.sharded for g in self.groups)
        self.agree = comm if sharded and comm.world_size > 1 else None
        # every flag read from memory (host gradients), and no rank to agree with
        self.in_place = all(g.host is not None for g in self.groups) and self.agree is None

    def fits(self, param_groups: list[dict[str, Any]]) -> bool:
        """Whether ``param_groups`` still hold as many parameters each as when the plan was made."""
        size = self.size
        if len(param_groups) != len(size):
            return False
        for group, n in zip(param_groups, size):
            if len(group["params"]) != n:
                return False
        return True

    def run(self, inv_scale: torch.Tensor | None = None) -> list[_Group]:
        """Run the check kernel on every group that has gradients (times ``inv_scale``); the groups checked."""
        checked = []
        for group in self.groups:
            grads = group.grads()
            if grads:
                factor = group.one if inv_scale is None else inv_scale.to(group.flag.device)
                check_and_unscale_(grads, group.flag, factor)
                checked.append(group)
        return checked


class _Group:
    """Parameters whose gradients share a device and dtype, with the check's flag tensors."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, sharded: bool) -> None:
        self.params, self.sharded = params, sharded
        # float32 whatever the default dtype (torch.set_default_dtype(torch.float64)): the kernel wants it
        self.flag = torch.zeros(1, device=device, dtype=torch.float32)  # stays 0 until a non-finite value is found
        self.one = torch.ones(1, device=device, dtype=torch.float32)
        self.host = self.flag.numpy() if self.flag.device.type == "cpu" else None  # a view of the flag

    def grads(self) -> list[torch.Tensor]:
        """The gradients there are (this rank's shard of each, for sharded parameters)."""
        if self.sharded:
            return [_local(p.grad) for p in self.params if p.grad is not None]
        return [p.grad for p in self.params if p.grad is not None]


def _plan(params: list[torch.Tensor]) -> list[_Group]:
    by_key: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
    for p in params:
        sharded = hasattr(p, "to_local")
        local = _local(p)
        by_key.setdefault((local.device, local.dtype, sharded), []).append(p)
    return [_Group(ps, device, sharded) for (device, _, sharded), ps in by_key.items()]


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters and gradients are DTensors: check this rank's shard (FiniteCheck then
    # agrees with the other ranks, which hold the other parts)
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def name_nonfinite_ranks(comm: Comm, local_loss: torch.Tensor | None) -> list[int]:
    """Gather which ranks saw a non-finite loss (called only on the rare bad step)."""
    bad = local_loss is not None and not bool(torch.isfinite(local_loss).all().item())
    flags = comm.all_gather_object(bad)
    return [r for r, f in enumerate(flags) if f]
