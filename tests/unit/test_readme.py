"""The README names exactly the metrics the exporter exports (the catalog), and the commands."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.metrics.catalog import METRICS, sample_names

ROOT = Path(__file__).resolve().parents[2]


def test_readme_names_every_catalog_metric_and_nothing_else() -> None:
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\bvllm_dp_[a-z_]+\b", text))
    known = {name for spec in METRICS for name in (spec.name, *sample_names(spec))}
    assert named - known == set(), "README names metrics the exporter does not export"
    assert {spec.name for spec in METRICS} - named == set(), "README misses catalog metrics"


def test_readme_and_ci_use_the_same_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)
