"""bench put --plot: a PNG of the bandwidth tables when matplotlib is present, a plain word when not."""

import argparse
import struct

import pytest

from flagcx_mesh.bench import _plot
from flagcx_mesh.bench.onesided import put, put_cuda

SIZES = [4096, 1 << 20, 16 << 20]


def _host_data():
    fig = {str(s): 1.0 + i for i, s in enumerate(SIZES)}
    data = {t: {"bandwidth_gbs": dict(fig)} for t in ("shm", "cma", "tcp")}
    data["memcpy_gbs"] = dict(fig)
    data["socket_gbs"] = {**fig, str(SIZES[0]): None}  # a missing figure is left out, not plotted as 0
    data["streams"], data["streams_gbs"] = 2, dict(fig)
    return data


def _cuda_data():
    fig = {str(s): 10.0 * (i + 1) for i, s in enumerate(SIZES)}
    row = {"gbs": fig, "gbs_blocking": fig}
    return {"gpu": "test GPU", "paths": {"cuda-ipc": row, "staged": row}, "local_d2d_gbs": fig,
            "local_d2d_blocking_gbs": fig, "pinned_round_gbs": fig}


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("bench,data,panels", [(put, _host_data, 1), (put_cuda, _cuda_data, 2)])
def test_plot_writes_a_png_with_a_panel_per_table(tmp_path, bench, data, panels):
    pytest.importorskip("matplotlib")
    out = tmp_path / "put.png"
    args = argparse.Namespace(plot=str(out), transports=["shm", "cma", "tcp"])
    assert bench.plot(data(), args) is True
    width, height = _png_size(out)
    assert width >= 600 * panels and height >= 450  # 6 x 4.5 inches a panel at 110 dpi


def test_no_plot_asked_writes_nothing(tmp_path):
    args = argparse.Namespace(plot=None, transports=["shm"])
    assert put.plot(_host_data(), args) is False
    assert list(tmp_path.iterdir()) == []


def test_without_matplotlib_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_plot, "have_matplotlib", lambda: False)
    out = tmp_path / "put.png"
    args = argparse.Namespace(plot=str(out), transports=["shm", "cma", "tcp"])
    assert put.plot(_host_data(), args) is False
    assert not out.exists()
    assert "matplotlib is not installed" in capsys.readouterr().err
