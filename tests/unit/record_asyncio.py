"""Re-record the asyncio hang reports of tests/unit/data/asyncio/ from real hangs, by the plugin.

Run it from the repository root (no torch needed; it takes about a minute)::

    python tests/unit/record_asyncio.py

It writes every scenario module of ``tests/asyncio_scenarios.py`` into a fresh directory, runs
each in a real pytest session of its own (pytest-asyncio; pytest-rerunfailures left out, as
the end-to-end tests do, so that its server thread is not in the pytest process) with
``--torch-hang-report-dir``, and keeps the first report of each hung test, written by the
plugin and not edited, as ``data/asyncio/<test name>.json``. ``data/asyncio/recording.json``
keeps the recording machine's stdlib directory, which the rules read (``frames.is_library``).
Re-record when the capture changes what a report holds; a rule change needs none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DATA = HERE / "data" / "asyncio"
sys.path[:0] = [str(HERE), str(HERE.parent)]

from record import first_reports  # noqa: E402

from asyncio_scenarios import INI, MODULES  # noqa: E402


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="torchhang-record-asyncio-"))
    try:
        (workdir / "pytest.ini").write_text(INI)
        for name, source in MODULES.items():
            (workdir / f"{name}.py").write_text(source.strip("\n") + "\n")
        path = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        for key in ("PYTEST_TORCH_HANG_TIMEOUT", "PYTEST_TORCH_HANG_DUMP_DIR", "PYTEST_ADDOPTS"):
            env.pop(key, None)
        command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider"]
        command += ["-p", "no:rerunfailures", "--torch-hang-timeout=2"]
        command += [f"--torch-hang-report-dir={workdir / 'reports'}"]
        for name in MODULES:  # a session each: no thread of one scenario in another's process
            subprocess.run([*command, f"{name}.py"], cwd=workdir, env=env, timeout=300, check=False)
        found = first_reports(workdir / "reports")
        if not found:
            print("no hang report: nothing written", file=sys.stderr)
            return 1
        shutil.rmtree(DATA, ignore_errors=True)
        DATA.mkdir(parents=True)
        for name, path in sorted(found.items()):
            shutil.copyfile(path, DATA / f"{name}.json")  # as the plugin wrote it, byte for byte
        machine = {
            "python": sys.version.split()[0],
            "stdlib": os.path.realpath(sysconfig.get_paths()["stdlib"]),
        }
        (DATA / "recording.json").write_text(json.dumps(machine, indent=1) + "\n")
        print(f"wrote {len(found)} reports to {DATA}")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
