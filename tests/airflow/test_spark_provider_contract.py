"""The apache-spark provider's private members airflow_arroyo.submit.provider uses, checked against the lowest
release pyproject.toml allows (installed by scripts/dev.sh into .cache/provider-contract/<version>) and the
installed one (constraints.txt pins the newest of the range). Each release runs in its own interpreter
(tests/airflow/_provider_contract.py), exercising every member; a failure names the member."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_provider_contract.py")


def _lowest_allowed() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("apache-airflow-providers-apache-spark"))
    found = re.search(r">=\s*([\d.]+)", spec)
    assert found, spec
    return found.group(1)


@pytest.mark.parametrize("release", ["lowest", "installed"])
def test_every_private_member_we_use_behaves_as_the_adapter_expects(release: str) -> None:
    args = [sys.executable, str(SCRIPT)]
    if release == "lowest":
        lowest = _lowest_allowed()
        folder = ROOT / ".cache" / "provider-contract" / lowest
        assert (folder / "airflow" / "providers" / "apache" / "spark").is_dir(), (
            f"provider {lowest} is not installed in {folder}: run scripts/dev.sh setup")
        args.append(str(folder))
        expected = lowest
    else:
        expected = importlib.metadata.version("apache-airflow-providers-apache-spark")
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # the release that ran is the one asked for (6.2 == 6.2.0)
    assert [int(p) for p in report["version"].split(".")] + [0] * 3 >= [int(p) for p in expected.split(".")]
    assert report["version"].split(".")[:2] == expected.split(".")[:2], report["version"]
    broken = {name: why for name, why in report["results"].items() if why != "ok"}
    assert not broken, "\n".join(f"{name}: {why}" for name, why in broken.items())
    assert len(report["results"]) == 6
