"""The README's two set-up commands, CI running the second one verbatim, and tox doing what it says."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_the_readme_has_exactly_two_commands_main_job_then_tests() -> None:
    main_job, tests = _readme_commands()
    assert "examples" in main_job and "--torch-hang-timeout" in main_job
    assert main_job.startswith('python -m pip install -e ".[test]" && ')
    assert tests == 'python -m pip install -e ".[test]" && python -m pytest -n 2'


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    _, tests = _readme_commands()
    assert tests in ci


def test_the_readme_tells_how_to_run_the_suite_on_a_busy_machine_and_tox_does_it() -> None:
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "tox -e stress" in section and "--cpu-hogs=2" in section
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert "--cpu-hogs=2" in tox["testenv:stress"]["commands"]


def test_tox_runs_the_fast_part_on_every_python_that_requires_python_names() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert oldest, project["requires-python"]
    classifiers = [c for c in project["classifiers"] if re.fullmatch(r".*:: 3\.\d+", c)]
    named = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers)
    assert named[0] == int(oldest.group(1)), named
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    env_list = tox["tox"]["env_list"]
    minors = "".join(f"{m}," for m in named).rstrip(",")
    assert f"py3{{{minors}}}-fast" in env_list, (env_list, named)
