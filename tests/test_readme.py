"""The README's two set-up commands, and CI running the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_the_readme_has_exactly_two_commands_main_job_then_tests() -> None:
    main_job, tests = _readme_commands()
    assert "examples" in main_job and "--torch-hang-timeout" in main_job
    assert main_job.startswith('python -m pip install -e ".[test]" && ')
    assert tests == 'python -m pip install -e ".[test]" && python -m pytest'


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    _, tests = _readme_commands()
    assert tests in ci
