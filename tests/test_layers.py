"""The source tree keeps its layering: a file in csrc/<layer>/ includes only its own layer,
the layers below it and the public C headers. The build enforces the same (each layer sees an
include root holding only those), so this test names a violation before a compiler does."""

import os
import re

import pytest

CSRC = os.path.join(os.path.dirname(__file__), os.pardir, "csrc")
# Bottom to top; "agent" (dynamic peers) sits beside "adaptor" (the build gives it no adaptor
# include root), "capi" is the C ABI, "testing" the test doubles, "python" the bindings.
ORDER = ["base", "transport", "bootstrap", "core", "adaptor", "agent", "capi", "testing", "python"]
ALLOWED_BESIDE = {"testing": {"capi"}, "python": {"testing", "capi"}}


def includes(path):
    with open(path) as f:
        return re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)


def sources():
    if not os.path.isdir(CSRC):
        pytest.skip("the source tree is not beside the tests (installed-only run)")
    for layer in ORDER:
        for root, _, files in os.walk(os.path.join(CSRC, layer)):
            for name in files:
                if name.endswith((".h", ".cc")):
                    yield layer, os.path.join(root, name)


def test_no_include_points_upward():
    bad = []
    for layer, path in sources():
        below = set(ORDER[:ORDER.index(layer) + 1]) | ALLOWED_BESIDE.get(layer, set())
        for inc in includes(path):
            top = inc.split("/")[0]
            if "/" in inc and top not in below:
                bad.append(f"{os.path.relpath(path, CSRC)} includes {inc}")
    assert not bad, "upward includes:\n" + "\n".join(bad)


def test_every_layer_folder_is_known():
    found = {d for d in os.listdir(CSRC) if os.path.isdir(os.path.join(CSRC, d))} if os.path.isdir(CSRC) else set()
    # fake_cuda: a test-only CUDA driver library of its own, outside the layers.
    assert found <= set(ORDER) | {"include", "fake_cuda"}, sorted(found - set(ORDER))
