"""Pieces every command-line program of the package shares."""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

# a module a command may lack -> the extra that installs it
EXTRAS = {"numpy": "bench", "matplotlib": "bench", "torch": "torch", "mpi4py": "mpi", "vllm": "vllm"}


def missing_dependency(e: ModuleNotFoundError, command: str) -> Optional[str]:
    """One line naming the extra that installs what `command` lacks, or None when the missing
    module is none of the optional dependencies (a real bug: let it raise)."""
    top = (e.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return (f"{command} needs {top}, which is not installed: "
            f"pip install 'flagcx_mesh[{EXTRAS[top]}]' (or pip install {top})")


def run_naming_extras(command: str, entry: Callable[[List[str]], int], argv: List[str]) -> int:
    """entry(argv); a missing optional dependency ends it with one line and exit status 2."""
    try:
        return entry(argv)
    except ModuleNotFoundError as e:
        line = missing_dependency(e, command)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def library_module_main(name: str, doc: str, use: str) -> int:
    """For a module that is a library, not a command: --help says what it is and which
    command runs it (exit 0); anything else says the same on stderr (exit 2)."""
    text = f"{name} is a library module, not a command. {use}\n\n{doc.strip()}"
    wants_help = any(a in ("-h", "--help") for a in sys.argv[1:])
    print(text, file=sys.stdout if wants_help else sys.stderr)
    return 0 if wants_help else 2
