"""Version tests of the shim modules: each private torch/CPython name they use still exists and
still behaves as the shim expects. A torch or Python upgrade that changes one fails here, with a
message naming the shim to update, instead of in a training run."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lockstep.checkpoint import torch_dcp
from lockstep.cli import py_argparse
from lockstep.comm import py_frames
from lockstep.launch import py_atexit, torch_agent
from lockstep.precision import torch_amp
from lockstep.strategies import torch_internals

VERSIONS = f"torch {torch.__version__}, Python {sys.version.split()[0]}"


def _changed(shim: Any, what: str) -> str:
    return f"{shim.__name__}: {what} changed in {VERSIONS}; update the shim (its callers only see its functions)"


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- lockstep.cli.py_argparse --------------------------------------------------------------------


def test_py_argparse_lists_every_action() -> None:
    parser = __import__("argparse").ArgumentParser()
    parser.add_argument("--nproc", type=int)
    parser.add_argument("script")
    actions = py_argparse.parser_actions(parser)
    assert [a.dest for a in actions] == ["help", "nproc", "script"], _changed(py_argparse, "ArgumentParser._actions")


# -- lockstep.precision.torch_amp ----------------------------------------------------------------


def test_torch_amp_check_kernel() -> None:
    flag, grads = torch.zeros(1), [torch.tensor([2.0, 4.0]), torch.tensor([1.0])]
    torch_amp.check_and_unscale_(grads, flag, torch.full((1,), 0.5))
    assert flag.item() == 0 and grads[0].tolist() == [1.0, 2.0], _changed(torch_amp, "torch._amp_foreach_...")
    torch_amp.check_and_unscale_([torch.tensor([float("nan")])], flag, torch.ones(1))
    assert flag.item() == 1, _changed(torch_amp, "torch._amp_foreach_non_finite_check_and_unscale_")


def test_c10d_default_timeout_is_a_module_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from lockstep.comm import group

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # restored after the test
        monkeypatch.setattr(distributed_c10d, name, getattr(distributed_c10d, name))
    group.default_timeout_for_scripts(timedelta(seconds=7))
    assert distributed_c10d._get_default_timeout("gloo") == timedelta(seconds=7), _changed(
        group, "distributed_c10d.default_pg_timeout"
    )


def test_torch_amp_version_counter_and_batchnorm_types() -> None:
    t = torch.zeros(2)
    before = torch_amp.version_of(t)
    t.add_(1)
    assert torch_amp.version_of(t) > before, _changed(torch_amp, "Tensor._version")
    t.detach().mul_(2)  # a view shares the counter: loading a state dict writes through one
    assert torch_amp.version_of(t) > before + 1, _changed(torch_amp, "Tensor._version")
    from torch.nn.modules.batchnorm import _BatchNorm

    def subclasses(cls: type) -> list[type]:
        return [s for c in cls.__subclasses__() for s in [c, *subclasses(c)]]

    torch_made = [c for c in subclasses(_BatchNorm) if c.__module__.startswith("torch.nn.")]
    missing = [c.__name__ for c in torch_made if not issubclass(c, torch_amp.BATCHNORM_TYPES)]
    assert not missing, _changed(torch_amp, f"the BatchNorm classes (new: {missing})")
    assert all(issubclass(c, _BatchNorm) for c in torch_amp.BATCHNORM_TYPES)


def test_verify_dropout_types_cover_torch() -> None:
    from torch.nn.modules.dropout import _DropoutNd

    from lockstep.verify import inputs

    torch_made = [c for c in _DropoutNd.__subclasses__() if c.__module__.startswith("torch.nn.")]
    assert set(torch_made) <= set(inputs._DROPOUTS), (
        f"lockstep.verify.inputs: torch's dropout classes changed in "
        f"{VERSIONS} (new: {set(torch_made) - set(inputs._DROPOUTS)})"
    )


# -- lockstep.strategies.torch_internals ---------------------------------------------------------


def test_torch_internals_release_ddp(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        for name in torch_internals.DDP_PROCESS_GROUP_HOLDERS:
            assert getattr(model, name, None) is not None, _changed(torch_internals, f"DDP's {name}")
        torch_internals.release_ddp(model)
        assert all(getattr(model, n) is None for n in torch_internals.DDP_PROCESS_GROUP_HOLDERS)
    finally:
        dist.destroy_process_group()


def test_torch_internals_powersgd_rule() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    assert _params(powerSGD_hook._should_compress) == [
        "num_rows",
        "num_cols",
        "matrix_approximation_rank",
        "min_compression_rate",
    ], _changed(torch_internals, "powerSGD_hook._should_compress")
    for rows, cols, rank, rate in ((64, 64, 1, 2), (2, 2, 1, 2), (4, 4, 1, 2), (3, 5, 2, 1), (10, 1, 1, 2)):
        expected = (rows + cols) * rank * rate < rows * cols
        assert torch_internals.powersgd_compresses(rows, cols, rank, rate) is expected, _changed(
            torch_internals, f"PowerSGD's rule at {(rows, cols, rank, rate)}"
        )


def test_torch_internals_compile() -> None:
    net = nn.Linear(2, 2)
    compiled = torch.compile(net, backend="eager")
    assert torch_internals.compiled_original(compiled) is net, _changed(torch_internals, "OptimizedModule._orig_mod")
    assert torch_internals.compiled_original(net) is None
    before = torch_internals.graphs_compiled()
    compiled(torch.ones(1, 2))
    assert torch_internals.graphs_compiled() > before, _changed(torch_internals, "torch._dynamo.utils.counters")


def test_torch_internals_backward_callback() -> None:
    calls: list[str] = []
    param = nn.Parameter(torch.ones(2))

    def accumulated(_: torch.Tensor) -> None:
        calls.append("grad")
        torch_internals.queue_backward_callback(lambda: calls.append("done"))

    param.register_post_accumulate_grad_hook(accumulated)
    (param * 2).sum().backward()
    assert calls == ["grad", "done"], _changed(torch_internals, "the autograd engine's queue_callback")


# -- lockstep.comm.py_frames, lockstep.launch.py_atexit ------------------------------------------


def test_py_frames_sees_another_thread() -> None:
    here = py_frames.thread_frame(threading.get_ident())
    assert here is not None and here.f_back is not None, _changed(py_frames, "sys._current_frames")
    assert here.f_back.f_code.co_name == "test_py_frames_sees_another_thread", _changed(
        py_frames, "sys._current_frames"
    )
    release = threading.Event()

    def parked() -> None:
        release.wait(10)

    thread = threading.Thread(target=parked)
    thread.start()
    try:
        names = []
        frame = py_frames.thread_frame(thread.ident)
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        assert "parked" in names, _changed(py_frames, "sys._current_frames")
    finally:
        release.set()
        thread.join()
    assert py_frames.thread_frame(None) is None


def test_py_frames_reaches_a_frame_further_up() -> None:
    def inner() -> Any:
        return py_frames.caller_frame(1)

    def middle() -> Any:
        return inner(), py_frames.caller_frame(0), py_frames.caller_frame(10**6)

    up_one, here, too_far = middle()
    assert up_one is not None and up_one.f_code.co_name == "middle", _changed(py_frames, "sys._getframe")
    assert here is not None and here.f_code.co_name == "middle", _changed(py_frames, "sys._getframe")
    assert too_far is None


def test_py_atexit_runs_handlers_early() -> None:
    script = textwrap.dedent("""
        import atexit
        from lockstep.launch.py_atexit import exit_hooks
        hooks = exit_hooks()
        before = hooks.count()
        atexit.register(print, "first registered")
        atexit.register(print, "last registered")
        assert hooks.count() == before + 2, "count"
        hooks.run_all()
        assert hooks.count() == 0, "cleared"
        print("after")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, _changed(py_atexit, f"atexit._ncallbacks/_run_exitfuncs: {out.stderr}")
    assert out.stdout.split("\n") == ["last registered", "first registered", "after", ""], _changed(
        py_atexit, "atexit._run_exitfuncs"
    )


# -- lockstep.launch.torch_agent, lockstep.checkpoint.torch_dcp ----------------------------------


def test_torch_agent_overrides_still_exist() -> None:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.launcher import api

    agent = api.LocalElasticAgent
    for method, params in (
        ("_start_workers", ["self", "worker_group"]),
        ("_monitor_workers", ["self", "worker_group"]),
        ("_restart_workers", ["self", "worker_group"]),
        ("_shutdown", ["self", "death_sig", "timeout"]),
    ):
        assert _params(getattr(agent, method, None) or (lambda: None)) == params, _changed(
            torch_agent, f"LocalElasticAgent.{method}"
        )
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    source = "".join(inspect.getsource(c) for c in agent.__mro__ if c.__module__.startswith("torch."))
    for attribute in ("self._pcontext", "self._remaining_restarts"):
        assert attribute in source, _changed(torch_agent, f"LocalElasticAgent's {attribute}")
    assert "self.subprocess_handlers" in inspect.getsource(SubprocessContext), _changed(
        torch_agent, "SubprocessContext.subprocess_handlers"
    )
    assert "self.proc" in inspect.getsource(SubprocessHandler), _changed(torch_agent, "SubprocessHandler.proc")
    assert {"SUCCEEDED", "FAILED", "UNHEALTHY"} <= set(WorkerState.__members__), _changed(torch_agent, "WorkerState")
    assert {"state", "failures"} <= set(RunResult.__dataclass_fields__), _changed(torch_agent, "RunResult")
    with torch_agent.reporting_agent(None):  # type: ignore[arg-type]  # only the swap is exercised
        assert api.LocalElasticAgent is not agent, _changed(torch_agent, "launcher.api.LocalElasticAgent")
    assert api.LocalElasticAgent is agent


def test_torch_dcp_set_nested() -> None:
    state: dict[str, Any] = {"optimizer": {"param_groups": [{"lr": 1.0}]}}
    torch_dcp.set_nested(state, ("optimizer", "param_groups", 0, "lr"), 0.1)
    torch_dcp.set_nested(state, ("extra", "step"), 3)
    assert state == {"optimizer": {"param_groups": [{"lr": 0.1}]}, "extra": {"step": 3}}, _changed(
        torch_dcp, "torch.distributed.checkpoint._traverse.set_element"
    )
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    original = {"optimizer": {"param_groups": [{"lr": 1.0}]}}
    planner.set_up_planner(original, None, True)
    path = planner.mappings["optimizer.param_groups.0.lr"]
    torch_dcp.set_nested(planner.original_state_dict, path, 0.5)
    assert planner.flatten_state_dict and original["optimizer"]["param_groups"][0]["lr"] == 0.5, _changed(
        torch_dcp, "DefaultLoadPlanner's mappings/original_state_dict"
    )


@pytest.mark.parametrize("shim", [torch_amp, torch_internals, py_frames, py_atexit, torch_agent, torch_dcp])
def test_every_shim_says_what_it_was_checked_on(shim: Any) -> None:
    assert "Checked on" in (shim.__doc__ or ""), shim.__name__


def test_torch_dcp_item_reader_reads_each_item_through_read_item(tmp_path: Path) -> None:
    import io

    import torch.distributed.checkpoint as dcp

    saved = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    asked: list[tuple[int, int]] = []

    class Recording(torch_dcp.ItemReader):
        def read_item(self, file: Any, offset: int, length: int) -> Any:
            asked.append((offset, length))
            file.seek(offset)
            return io.BytesIO(file.read(length))

    loaded = {"a": torch.zeros(6), "b": torch.zeros(2, 3)}
    dcp.load(loaded, storage_reader=Recording(tmp_path), no_dist=True)
    assert len(asked) == 2 and all(length > 0 for _, length in asked), _changed(
        torch_dcp, "FileSystemReader._slice_file (no longer called once per item)"
    )
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), _changed(torch_dcp, "FileSystemReader._slice_file")
