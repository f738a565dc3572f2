"""Run ``lockstep bench`` in this process on :func:`support.models.tiny_model` and read its results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lockstep.cli.main import main as cli_main


def run_bench(tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    argv = [
        "bench",
        "--model",
        "support.models:tiny_model",
        "--image-size",
        "4",
        "--channels",
        "1",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        "--progress",
        "off",
        *flags,
    ]
    code = cli_main(argv)
    doc = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else {}
    return code, doc
