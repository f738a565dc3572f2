"""``lockstep bench``: which strategy x precision x process count is fastest on this machine.

Every cell of the matrix trains the model with ``lockstep.Session(strategy, precision)`` in new
processes (``lockstep.launch.spawn``): warm-up steps, then a timed window between device
synchronisations. The figures (samples/s per rank and in total, scaling efficiency, step-time
median and spread, peak memory) come back to the parent, which prints a table, writes
``results.json`` and draws ``bench.png``. Cells that cannot run here are listed with the reason.

* :mod:`~lockstep.bench.matrix`: the configuration, the cells and their skip reasons;
* :mod:`~lockstep.bench.measure`: one cell on one rank (warm-up, timed window);
* :mod:`~lockstep.bench.run`: the matrix over fresh processes, aggregation, efficiency;
* :mod:`~lockstep.bench.report`: the table, ``results.json`` (its schema) and the PNG.

An app: may import the library and ``lockstep.zoo`` (models, data, the flags' SessionConfig), never another app.

Example::

    lockstep bench --model convnet --nproc 1,2 --strategies single,ddp,fsdp --precision fp32,bf16-mixed

    from lockstep.bench import BenchConfig, run_bench, format_table
    doc = run_bench(BenchConfig(model="resnet18", nprocs=(1, 2), steps=10))
    print(format_table(doc))
"""

from __future__ import annotations

from lockstep.bench.matrix import BenchConfig, Cell, plan_cells, skip_reason
from lockstep.bench.measure import CellTask, measure_cell
from lockstep.bench.report import format_table, plot_results, write_outputs
from lockstep.bench.run import SCHEMA_VERSION, add_efficiency, run_bench

__all__ = [
    "BenchConfig",
    "Cell",
    "plan_cells",
    "skip_reason",
    "CellTask",
    "measure_cell",
    "run_bench",
    "add_efficiency",
    "format_table",
    "plot_results",
    "write_outputs",
    "SCHEMA_VERSION",
]
