"""Each feature declared once (dynamo_spec/engine/features.py): the README's table is what the
declarations render, and the patches they name are the patches of vLLM there are."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_spec.engine import features
from dynamo_spec.vllm_patches import PATCHES

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- engine/features.py readme_table() -->\n", "\n<!-- /readme_table() -->"


def test_the_readmes_table_is_what_the_declarations_render():
    text = README.read_text()
    start = text.index(BEGIN) + len(BEGIN)
    assert text[start:text.index(END, start)] == features.readme_table(), (
        "README.md's 'Where each feature runs' table differs from the declarations: paste "
        "`python -c 'from dynamo_spec.engine import features; print(features.readme_table())'` between its markers")


def test_the_table_says_where_each_feature_is_refused_or_inactive():
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[-2:] for line in features.readme_table().splitlines()[2:]}
    assert rows["confidence draft budget"] == ["yes", "refused |"]
    assert rows["draft-side penalties"] == ["yes", "inactive |"]
    assert rows["speculation guard"] == ["yes", "yes |"]


def test_every_feature_patch_backs_a_declared_feature_and_every_named_patch_exists():
    modules = {p.module for p in PATCHES}
    named = {m for f in features.FEATURES for m in f.patches}
    assert named <= modules, named - modules
    assert {p.module for p in PATCHES if p.kind == "feature"} <= named
