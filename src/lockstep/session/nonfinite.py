"""The non-finite loss policy: the per-step gradient check, naming the ranks, one decision on every rank.

With gradients on an accelerator, ``"skip"`` and a fused optimizer, the check's flag is not read
on the host but lent to the optimizer as ``found_inf`` (it skips a bad step on the device), and the
skipped steps are read every ``read_every`` steps, before a save and at the end (:class:`LateSkips`).
Elsewhere the flag is read once per step. The policy counts nothing: the session's ``TrainState`` does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError, LockstepError, format_ranks
from lockstep.precision.torch_amp import (
    check_and_unscale_,
    hand_found_inf,
    has_grad_scale,
    steps_on_found_inf,
    take_found_inf,
)

__all__ = [
    "FiniteCheck",
    "NonFinitePolicy",
    "NonFiniteLossError",
    "StepDecision",
    "LateSkips",
    "GO_AHEAD",
    "NONFINITE_POLICIES",
    "READ_EVERY",
    "name_nonfinite_ranks",
]

NONFINITE_POLICIES = ("skip", "stop", "ignore")
READ_EVERY = 50
"""Steps between two host reads of the skipped-step count on the no-sync path."""


class NonFiniteLossError(LockstepError):
    """The loss became NaN or infinite and the session was told to stop (``nonfinite="stop"``), or it was
    non-finite ``MAX_SKIPS_IN_A_ROW`` (20) steps in a row under ``"skip"``: the run diverged. Raised on
    every rank; ``lockstep train`` and ``lockstep run`` exit with code 1 (``EXIT_FAILURE``)."""


@dataclass(frozen=True)
class StepDecision:
    """Whether an optimizer step goes ahead (``take``), and the warning (``message``) when it was skipped everywhere."""

    take: bool = True
    message: str = ""


@dataclass(frozen=True)
class LateSkips:
    """Steps counted as taken that the optimizer skipped on the device (``steps``), and the warning."""

    steps: int = 0
    message: str = ""


GO_AHEAD = StepDecision()
"""The decision of a step that goes ahead."""
NO_LATE_SKIPS = LateSkips()


class NonFinitePolicy:
    """What a session does when the loss turns NaN/inf on any rank; every rank decides alike.

    Args:
        policy: ``"skip"``, ``"stop"`` or ``"ignore"``.
        comm: the job's collectives (to name the ranks, and to agree on sharded gradients).
        defer: lend the flag to fused optimizers: ``None`` only for gradients on an accelerator,
            True wherever the optimizer can, False never.
        read_every: steps between two host reads of the steps skipped on the device.
    """

    def __init__(
        self, policy: str, comm: Comm | None = None, *, defer: bool | None = None, read_every: int = READ_EVERY
    ) -> None:
        if read_every < 1:
            raise ConfigError(f"read_every must be at least 1, got {read_every!r}")
        self.policy = policy
        self.active = policy != "ignore"
        self.loss: torch.Tensor | None = None
        self.defer, self.read_every = defer, read_every
        self.comm = comm
        self.check = FiniteCheck(comm)
        self._lent: list[tuple[torch.optim.Optimizer, _Plan]] = []  # optimizers stepping with our flag
        self._unread = 0  # steps since the host last read the skipped steps
        self._first = 0  # the first step of that window

    def record(self, loss: torch.Tensor) -> None:
        """Keep this micro-step's loss, to tell which ranks saw a non-finite one."""
        if self.active:
            self.loss = loss.detach()

    def decide(self, optimizer: torch.optim.Optimizer, step: int, epoch: int) -> StepDecision:
        """Whether the step goes ahead; raises :class:`NonFiniteLossError` under ``"stop"``.

        On the lent-flag path the step goes ahead and :meth:`after_step` must follow it.
        """
        if not self.active:
            return GO_AHEAD
        if self.policy == "skip" and self.check.lend_flag(optimizer, self.loss, self.defer):
            if not self._unread:
                self._first = step
            self._unread += 1
            self._lent.append((optimizer, self.check.plan(optimizer)))
            return GO_AHEAD  # the optimizer skips a bad step itself; reported by count_late_skips()
        if self.check(optimizer):
            return GO_AHEAD
        ranks = name_nonfinite_ranks(self.comm, self.loss) if self.comm is not None else []
        text = f"non-finite loss on {format_ranks(ranks) if ranks else 'a rank'} at step {step} (epoch {epoch})"
        if self.policy == "stop":
            raise NonFiniteLossError(f"{text}; stopping every rank (nonfinite='stop')")
        return StepDecision(False, f"lockstep: warning: {text}; the step was skipped on every rank")

    def after_step(self) -> LateSkips:
        """Take a lent flag back; every ``read_every`` such steps, :meth:`count_late_skips`."""
        if not self._lent:
            return NO_LATE_SKIPS
        for optimizer, plan in self._lent:
            plan.take_flag_back(optimizer)
        self._lent = []
        return self.count_late_skips() if self._unread >= self.read_every else NO_LATE_SKIPS

    def count_late_skips(self, name_ranks: bool = True) -> LateSkips:
        """Read the steps the optimizers skipped on the device since the last read (one host sync).

        Every rank calls it at the same step; ``name_ranks`` gathers which ranks saw a non-finite loss
        (a collective: False where not every rank may call it).
        """
        window, first, self._unread = self._unread, self._first, 0
        if not window:
            return NO_LATE_SKIPS  # nothing went through the optimizer's flag: nothing to read
        skipped, bad_loss = self.check.read_skipped()
        if not skipped:
            return NO_LATE_SKIPS
        ranks: list[int] = []
        if name_ranks and self.comm is not None and self.comm.world_size > 1:
            flags = self.comm.all_gather_object(bad_loss)
            ranks = [r for r, f in enumerate(flags) if f]
        elif bad_loss:
            ranks = [self.comm.rank if self.comm is not None else 0]
        where = format_ranks(ranks) if ranks else "a rank"
        last = first + window - 1
        return LateSkips(
            skipped,
            f"lockstep: warning: non-finite loss on {where}: {skipped} of steps {first}-{last} skipped on every rank",
        )


class FiniteCheck:
    """Whether every gradient an optimizer is about to apply is finite.

    Runs GradScaler's fused kernel (unscaling by 1) per device and dtype, on the optimizer's
    parameters (so every model a session set up is covered); the grouping and flags are kept between steps.
    """

    def __init__(self, comm: Comm | None = None) -> None:
        self.comm = comm
        self._plans: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()

    def plan(self, optimizer: torch.optim.Optimizer) -> _Plan:
        """The check's plan for ``optimizer``, remade when its groups change size."""
        param_groups = optimizer.param_groups
        size = tuple(len(g["params"]) for g in param_groups)
        plan = self._plans.get(optimizer)
        if plan is None or plan.size != size:
            # every parameter, frozen ones too: one unfrozen later has its gradient checked
            plan = _Plan(size, [p for g in param_groups for p in g["params"]], self.comm)
            self._plans[optimizer] = plan
        return plan

    def lend_flag(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None, defer: bool | None) -> bool:
        """Check on the device and lend the flag to ``optimizer`` as its ``found_inf``; False (nothing done)
        unless that spares a host sync and the optimizer skips a flagged step itself.
        """
        if defer is False or not steps_on_found_inf(optimizer):
            return False
        if has_grad_scale(optimizer):
            return False  # a GradScaler drives this optimizer's flag
        plan = self.plan(optimizer)
        if plan.agree is not None or not plan.groups or (defer is None and plan.on_host):
            return False
        plan.lend_flag(optimizer, loss)
        return True

    def read_skipped(self) -> tuple[int, bool]:
        """Steps skipped through :meth:`lend_flag` since the last call, and whether this rank's loss was not finite."""
        skipped, bad_loss = 0, False
        for plan in list(self._plans.values()):
            count, bad = plan.read_skipped()  # one session step steps one optimizer: the counts add up
            skipped, bad_loss = skipped + count, bad_loss or bad
        return skipped, bad_loss

    def __call__(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when every gradient of ``optimizer``'s parameters is finite (``None`` ones are skipped)."""
        plan = self.plan(optimizer)
        checked = plan.run()
        if plan.agree is not None:
            # a shard holds only its part of each gradient: a non-finite element is seen by the
            # rank that owns it alone, so the ranks agree on the flag (one small all_reduce)
            total = torch.zeros(1, device=plan.groups[0].flag.device)
            for group in checked:
                total += group.flag.to(total.device)
            bad = bool(plan.agree.all_reduce(total, "max").item())
        elif not checked:
            return True
        elif plan.on_host:  # read the flags' memory: no tensor op, no sync
            bad = any(g.host[0] for g in checked)  # type: ignore[index]
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

    def __init__(self, size: tuple[int, ...], params: list[torch.Tensor], comm: Comm | None) -> None:
        self.size = size
        self.groups = _plan(params)
        self.on_host = all(g.host is not None for g in self.groups)
        sharded = any(g.sharded for g in self.groups)
        self.agree = comm if sharded and comm is not None and comm.world_size > 1 else None
        device = self.groups[0].flag.device if self.groups else torch.device("cpu")
        # the lent-flag path's tensors, on the first group's device: the optimizer's found_inf (a
        # 0-dim float, 1.0 when any group saw a non-finite value), the steps skipped since the
        # last read, and whether this rank's loss was ever non-finite in that window
        self.found = torch.zeros((), device=device)
        self.skipped = torch.zeros((), device=device)
        self.bad_loss = torch.zeros((), dtype=torch.bool, device=device)

    def run(self) -> list[_Group]:
        """Run the check kernel on every group that has gradients; the groups checked."""
        checked = []
        for group in self.groups:
            if group.sharded:
                grads = [_local(p.grad) for p in group.params if p.grad is not None]
            else:
                grads = [p.grad for p in group.params if p.grad is not None]
            if grads:
                check_and_unscale_(grads, group.flag, group.one)
                checked.append(group)
        return checked

    def lend_flag(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None) -> None:
        """Set ``optimizer.found_inf`` from the check, without reading it on the host."""
        self.found.zero_()
        for group in self.run():
            torch.maximum(self.found, group.flag.reshape(()).to(self.found.device), out=self.found)
            group.flag.zero_()  # no read, so no way to know: clear it for the next step anyway
        if loss is not None:
            self.bad_loss |= ~torch.isfinite(loss.detach()).all().to(self.bad_loss.device)
        hand_found_inf(optimizer, self.found)  # read by fused optimizers' step

    def take_flag_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Take ``found_inf`` back (a later step outside the session must not see it) and count it."""
        take_found_inf(optimizer, self.found)
        self.skipped += self.found

    def read_skipped(self) -> tuple[int, bool]:
        """Read and reset the skipped count and the loss flag (the host sync)."""
        count, bad = int(self.skipped.item()), bool(self.bad_loss.item())
        self.skipped.zero_()
        self.bad_loss.zero_()
        return count, bad


class _Group:
    """Parameters whose gradients share a device and dtype, with the check's flag tensors."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, sharded: bool) -> None:
        self.params, self.sharded = params, sharded
        self.flag = torch.zeros(1, device=device)  # stays 0 until a non-finite value is found
        self.one = torch.ones(1, device=device)
        self.host = self.flag.numpy() if self.flag.device.type == "cpu" else None  # a view of the flag


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
