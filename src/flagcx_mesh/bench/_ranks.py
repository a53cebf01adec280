"""Running a benchmark's rank processes under the embedded launcher and collecting their result."""

import json
import os
import sys
import tempfile
from typing import Any, List, Optional


def run_ranks(name: str, rank_args: List[str], nranks: int, timeout: float) -> Optional[Any]:
    """Runs ``python -m flagcx_mesh.bench RANK_ARGS --out PATH`` on nranks local ranks and
    returns the JSON that rank 0 wrote to PATH; None (after saying why) when the ranks failed."""
    from ..launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        rc = launch([sys.executable, "-m", "flagcx_mesh.bench", *rank_args, "--out", path], nranks,
                    timeout=timeout)
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
