"""PNG plots of a benchmark's bandwidth tables (``--plot PATH``), when matplotlib is present.

Each series is a label and a mapping from size in bytes (as the JSON keys them: decimal
strings) to GB/s; missing or None figures are left out. Without matplotlib (``pip install
.[bench]`` brings it), ``save_plot`` says so and writes nothing: the figures are still printed
and saved with ``--json``.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ._sizes import size_name

Series = Mapping[str, Optional[float]]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _points(series: Series) -> Tuple[List[int], List[float]]:
    pts = sorted((int(k), float(v)) for k, v in series.items() if v is not None)
    return [s for s, _ in pts], [v for _, v in pts]


def save_plot(path: Optional[str], title: str, panels: Sequence[Tuple[str, Dict[str, Series]]]) -> bool:
    """Writes one PNG with a panel per (subtitle, {label: series}); log-log axes, GB/s over size.
    Returns whether a file was written."""
    if not path:
        return False
    if not have_matplotlib():
        print(f"--plot {path}: matplotlib is not installed (pip install .[bench]); no plot written",
              file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (subtitle, series) in zip(axes[0], panels):
        sizes: List[int] = []
        for label, s in series.items():
            xs, ys = _points(s)
            if xs:
                ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label.startswith("ref:") else "-")
                sizes = sorted(set(sizes) | set(xs))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [size_name(s) for s in sizes])
        ax.set_xlabel("bytes per op")
        ax.set_ylabel("GB/s")
        ax.set_title(subtitle)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
    return True
