"""``lockstep export RUN OUT.pt``: a checkpoint's model as one plain ``state_dict`` file.

Reads the newest checkpoint of ``RUN`` that verifies (or the ``step-N`` folder given), puts each
tensor back together whole, whatever strategy and world size wrote it, and writes the model's own
``state_dict`` with ``torch.save``: the keys of the bare module, with no wrapper's prefix. Examples::

    lockstep export checkpoints model.pt
    lockstep export runs/flowers/step-000120 flowers.pt
    lockstep export checkpoints ema.pt --name ema        # a model saved as session.save(..., ema=ema)

Then, with no lockstep needed: ``net.load_state_dict(torch.load("model.pt"))``.
"""

from __future__ import annotations

import argparse

from lockstep.cli.flags import describe_command

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``lockstep export``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    describe_command(parser, __doc__)
    parser.add_argument(
        "run", metavar="RUN", help="a checkpoint folder (its newest good checkpoint), or a step-N folder"
    )
    parser.add_argument("out", metavar="OUT", help="the file to write (torch.save of the model's state_dict)")
    parser.add_argument(
        "--name",
        default="model",
        metavar="NAME",
        help="the model's name in the checkpoint: model (session.save's model=), or a name it was saved "
        "under, e.g. ema (default model)",
    )


def main(args: argparse.Namespace) -> int:
    """Export the model and say where from.

    Args:
        args: the parsed arguments of :func:`add_arguments`.

    Example::

        main(argparse.Namespace(run="checkpoints", out="model.pt", name="model"))
    """
    from lockstep.checkpoint.export import export_model

    path, step = export_model(args.run, args.out, args.name)
    print(f"lockstep export: {args.name} of {path} (step {step}) written to {args.out}", flush=True)
    return 0
