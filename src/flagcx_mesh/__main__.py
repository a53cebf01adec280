"""flagcx_mesh's command-line programs, by name.

    python -m flagcx_mesh COMMAND [ARGS...]      (the same as python -m flagcx_mesh.COMMAND ARGS...)
    python -m flagcx_mesh COMMAND --help         (that command's options)
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional, Tuple

# name -> (module, what it does); each module has main(argv) -> exit status
COMMANDS: Tuple[Tuple[str, str, str], ...] = (
    ("selftest", "selftest", "build the mesh on N local ranks (or under a launcher) and check every connection"),
    ("launch", "launch", "start N local ranks of a command that share one unique id"),
    ("bench", "bench.__main__", "benchmarks, each beside a peer measured in the same run (numpy: [bench])"),
    ("config", "config", "compiler, linker, CMake and pkg-config paths of the C library"),
)


def usage() -> str:
    width = max(len(name) for name, _, _ in COMMANDS)
    lines = [__doc__.strip(), "", "commands:"]
    lines += [f"  {name.ljust(width)}  {what}" for name, _, what in COMMANDS]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    modules = {name: module for name, module, _ in COMMANDS}
    if argv[0] not in modules:
        print(f"python -m flagcx_mesh: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{modules[argv[0]]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
