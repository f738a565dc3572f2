"""``lockstep bench``: which strategy x precision x process count is fastest on this machine.

Each cell of the matrix trains in fresh processes; the parent prints a table, writes
``results.json`` and draws ``bench.png``. Run it as
``lockstep bench --model convnet --nproc 1,2 --strategy single,ddp,fsdp --precision fp32,bf16-mixed``.

* :mod:`~lockstep.bench.matrix`: the configuration, the cells and their skip reasons;
* :mod:`~lockstep.bench.measure`: one cell on one rank (warm-up, timed window);
* :mod:`~lockstep.bench.run`: the matrix over fresh processes, aggregation, efficiency;
* :mod:`~lockstep.bench.report`: the table, ``results.json`` (its schema) and the PNG.

An app: may import the library and ``lockstep.zoo`` (models, data, the flags' SessionConfig), never another app.
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
