"""Running a benchmark's rank processes under the embedded launcher and collecting their result."""

import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional


def run_ranks(name: str, rank_args: List[str], nranks: int, timeout: float) -> Optional[Any]:
    """Runs ``python -m flagcx_mesh.bench RANK_ARGS --out PATH`` on nranks local ranks and
    returns the JSON that rank 0 wrote to PATH; None (after saying why) when the ranks failed."""
    return run_program(name, [sys.executable, "-m", "flagcx_mesh.bench", *rank_args], nranks, timeout)


def run_program(name: str, cmd: List[str], nranks: int, timeout: float,
                env: Optional[Dict[str, str]] = None) -> Optional[Any]:
    """Runs ``CMD --out PATH`` (any program, e.g. a compiled C benchmark) on nranks local ranks,
    with `env` added to their environment, and returns the JSON that rank 0 wrote to PATH;
    None (after saying why) when the ranks failed."""
    from ..launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        rc = launch([*cmd, "--out", path], nranks, timeout=timeout, env=env)
        if rc != 0:
            print(f"bench {name}: the rank processes failed (exit {rc})", file=sys.stderr)
            return None
        with open(path) as f:
            return json.load(f)


def save_json(data: Any, path: Optional[str]) -> None:
    """Writes the figures to path (--json), when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
