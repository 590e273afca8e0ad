"""Every MFU the suite's runs wrote, read back: none may exceed 1 (#31: a figure above the machine's
peak makes a user distrust every other number). conftest.py runs `audit` over the session's temporary
directory at the end, so every strategy's run here is checked without running anything twice."""

import csv
import json
from pathlib import Path

FILES = ("summary.json", "plan.json", "metrics.csv", "sweep_summary.csv")


def _json_mfus(value, where: str):
    """Every number under an "mfu" key, at any depth (plan.json keeps one per role and per layout)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "mfu" and isinstance(item, (int, float)):
                yield where, float(item)
            else:
                yield from _json_mfus(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _json_mfus(item, f"{where}[{index}]")


def mfus(path: Path):
    """(where, value) for each MFU a run file holds."""
    if path.suffix == ".json":
        try:
            yield from _json_mfus(json.loads(path.read_text()), path.name)
        except (ValueError, OSError):  # a file a fault-injection test left half-written
            return
        return
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            if row.get("mfu") not in (None, ""):
                yield f"{path.name}:{number}", float(row["mfu"])


def audit(root: Path):
    """(files read, MFU values read, the ones above 1 as "path where value")."""
    files, values, above = 0, 0, []
    for name in FILES:
        for path in Path(root).rglob(name):
            files += 1
            for where, value in mfus(path):
                values += 1
                if value > 1:
                    above.append(f"{path.parent}: {where} = {value:.3f}")
    return files, values, above
