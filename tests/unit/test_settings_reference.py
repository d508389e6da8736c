"""docs/serving/settings.md is the option table of tokenmill/settings.py, rendered: it fails here when the
two differ (regenerate with `python -m tokenmill.settings > docs/serving/settings.md`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from conftest import ROOT

from tokenmill.settings import OPTIONS, ServeSettings, add_arguments, reference

DOC = ROOT / "docs" / "serving" / "settings.md"


def test_the_document_is_the_table_rendered():
    assert DOC.read_text(encoding="utf-8") == reference(), (
        "docs/serving/settings.md is stale: python -m tokenmill.settings > docs/serving/settings.md"
    )


def test_every_serve_flag_and_setting_is_in_the_document():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    documented = set(re.findall(r"^\| `(--[a-z0-9-]+)`", DOC.read_text(encoding="utf-8"), re.M))
    assert flags - {"--config", "--help"} == documented
    assert {f.name for f in fields(ServeSettings)} == set(OPTIONS)  # no setting without a flag, nor the reverse
    for name in OPTIONS:
        assert f"`TOKENMILL_{name.upper()}`" in DOC.read_text(encoding="utf-8"), name
