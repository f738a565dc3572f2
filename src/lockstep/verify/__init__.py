"""``lockstep verify``: does training on N processes equal training on one?

The model is trained twice from the same initial weights with plain SGD (no momentum, so that
differences are not amplified) on the same fixed sequence of global batches:

* one process, in this process, on each global batch of ``batch`` samples whole;
* ``nproc`` processes started by the launcher of ``lockstep run``, under the chosen strategy
  and precision, rank ``r`` training on the contiguous slice ``[r*batch/N, (r+1)*batch/N)`` of
  each global batch (in ``accumulate`` micro-batches). Rank 0 writes the results back.

Then the loss curves, every parameter and buffer, and every module's first forward output are
compared (see :mod:`lockstep.verify.compare`), and a verdict is printed: ``EQUIVALENT within
tolerance T`` (1e-5 relative for fp32, 1e-2 for bf16 and fp16), or ``NOT EQUIVALENT`` naming the
first differing layers and the likely cause (see :mod:`lockstep.verify.diagnose`).

* :mod:`~lockstep.verify.config`: what to compare, validated before any process starts;
* :mod:`~lockstep.verify.inputs`: the model, loss and fixed batches, and each rank's slice;
* :mod:`~lockstep.verify.run`: the two trainings (the N ranks started with
  :func:`lockstep.launch.relaunch.relaunch`), and the workers' entry point;
* :mod:`~lockstep.verify.record`: every module's output in the first forward pass;
* :mod:`~lockstep.verify.compare`: the loss curves, weights and outputs side by side;
* :mod:`~lockstep.verify.diagnose`: the likely cause of a difference;
* :mod:`~lockstep.verify.report`: the text printed.

An app: may import the library and ``lockstep.zoo``, never another app.

Example::

    lockstep verify --model convnet --nproc 2
    lockstep verify --model mypkg.nets:make_mlp --shape 32 --strategy fsdp --accumulate 2

or from Python::

    from lockstep.verify import VerifyConfig, run_verify
    exit_code = run_verify(VerifyConfig(model="mypkg.nets:make_mlp", shape=(32,)))
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

    Example::

        ok, text = verify(VerifyConfig(model="convnet", steps=3))
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

    Example::

        sys.exit(run_verify(VerifyConfig(model="convnet")))
    """
    equivalent, text = verify(config)
    print(text, flush=True)
    return 0 if equivalent else 1
