"""``lockstep verify``: does training on N processes equal training on one?

The model is trained twice from the same weights with plain SGD on the same global batches, once
in this process and once on ``nproc`` processes, each rank on its contiguous slice of every batch;
the loss curves, weights and first forward outputs are compared and a verdict printed. Run it as
``lockstep verify --model convnet --nproc 2``.

* :mod:`~lockstep.verify.config`: what to compare, validated before any process starts;
* :mod:`~lockstep.verify.inputs`: the model, loss and fixed batches, and each rank's slice;
* :mod:`~lockstep.verify.run`: the two trainings, and the workers' entry point;
* :mod:`~lockstep.verify.record`: every module's output in the first forward pass;
* :mod:`~lockstep.verify.compare`: the loss curves, weights and outputs side by side;
* :mod:`~lockstep.verify.diagnose`: the likely cause of a difference;
* :mod:`~lockstep.verify.report`: the text printed.

An app: may import the library and ``lockstep.zoo``, never another app.
"""

from __future__ import annotations

from lockstep.verify.config import VerifyConfig

__all__ = ["VerifyConfig", "run_verify", "verify"]


def verify(config: VerifyConfig) -> tuple[bool, str]:
    """Run both trainings, compare them, and return ``(equivalent, report text)``.

    Args:
        config: what to compare.

    Raises:
        ConfigError: a bad model, dataset, loss or precision (found before the N processes start).
        VerifyRunError: the N-process training failed.
    """
    from lockstep.verify.compare import compare_runs
    from lockstep.verify.diagnose import diagnose, model_facts
    from lockstep.verify.inputs import build_model, make_batches
    from lockstep.verify.report import format_report
    from lockstep.verify.run import initial_state, run_parallel, run_reference

    init = initial_state(config)
    batches = make_batches(config)
    reference = run_reference(config, init, batches)  # first: a bad model fails here, in one process
    parallel = run_parallel(config, init, batches)
    comparison = compare_runs(reference, parallel, init, build_model(config), config)
    facts = model_facts(config, init, batches[0])
    diagnosis = diagnose(comparison, facts, config)
    return diagnosis.equivalent, format_report(config, comparison, facts, diagnosis)


def run_verify(config: VerifyConfig) -> int:
    """Print the comparison's report and return the exit code: 0 equivalent, 1 not.

    Args:
        config: what to compare.
    """
    equivalent, text = verify(config)
    print(text, flush=True)
    return 0 if equivalent else 1
