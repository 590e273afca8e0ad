"""The claim runner of mode=reproduce (layerwise/reproduce/__init__.py): what it writes and refuses.
Each claim's own arithmetic is tested in tests/test_reproduce_<claim>.py."""

import csv
import json
import sys
import types

import pytest
from omegaconf import OmegaConf

from layerwise.reproduce import CLAIMS, Finding, Verdict, reproduce


def test_a_verdict_outside_the_four_words_is_refused():
    with pytest.raises(ValueError, match="verdict 'probably' is not one of reproduced"):
        Verdict("x", "y", "z", "probably", "because")


def test_every_claim_has_an_experiment_at_both_scales():
    from pathlib import Path

    conf = Path(__file__).resolve().parent.parent / "conf" / "experiment"
    missing = [f"repro_{claim}{suffix}.yaml" for claim in CLAIMS for suffix in ("", "_small")
               if not (conf / f"repro_{claim}{suffix}.yaml").exists()]
    assert not missing, f"experiments missing: {missing}"


def test_reproduce_runs_the_chosen_scale_and_writes_every_table(tmp_path, monkeypatch):
    calls = []

    def at_scale(scale):
        def test(cfg, directory):
            calls.append((scale, directory))
            (directory / "figure.png").write_bytes(b"png")
            return Finding([Verdict("halves the time", "0.52×", "", "reproduced", "bubble")],
                           {"times": [{"model": "1B", "seconds": 1.25}, {"model": "8B", "seconds": 3.5}]},
                           ["figure.png"])
        return test

    fake = types.SimpleNamespace(at_paper_scale=at_scale("paper"), at_small_scale=at_scale("small"))
    monkeypatch.setitem(sys.modules, "layerwise.reproduce.l2l", fake)
    cfg = OmegaConf.create({"reproduce": {"claim": "l2l", "scale": "small"}})
    reproduce(cfg, tmp_path)
    assert calls == [("small", tmp_path)]
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["verdicts"][0]["prediction"] == "0.52×" and document["scale"] == "small"
    assert list(csv.DictReader((tmp_path / "times.csv").open())) == [
        {"model": "1B", "seconds": "1.25"}, {"model": "8B", "seconds": "3.5"}]
    page = (tmp_path / "results.md").read_text()
    assert "| halves the time | 0.52× | — | **reproduced** | bubble |" in page
    assert "| 8B | 3.5 |" in page and "![figure.png](figure.png)" in page
    assert not list(tmp_path.glob("*.partial"))
