"""docs/c-api.md gives every call of flagcx_mesh.h with its signature, so that a C program can be
written from it (the declarations as the installed header has them, whitespace aside)."""

import os
import re

import pytest

import flagcx_mesh

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "c-api.md")


def _declarations(text):
    """Every FLAGCX_MESH_API declaration after the header's first section, one line each."""
    text = re.sub(r"/\*.*?\*/", " ", text[text.index("/* -----"):], flags=re.S)
    found = re.findall(r"FLAGCX_MESH_API\s+([^;]*;)", text)
    return [re.sub(r"\s*([(),*])\s*", r"\1", " ".join(d.split())) for d in found]


def test_the_doc_gives_every_signature():
    if not os.path.exists(DOC):
        pytest.skip("docs/ is not beside the tests")
    header = open(os.path.join(flagcx_mesh.get_include(), "flagcx_mesh.h")).read()
    declared = _declarations(header)
    assert len(declared) > 30, declared
    doc = re.sub(r"\s*([(),*])\s*", r"\1", " ".join(open(DOC).read().split()))
    missing = [d for d in declared if d not in doc]
    assert not missing, f"docs/c-api.md lacks {len(missing)} signatures, e.g. {missing[:3]}"
