"""The package as an index user gets it: sdist and wheel, their LICENSE, URLs and examples, and the
wheel installed into a fresh venv running an example hang with ``python -m pytest_torchhang``."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import uuid
import venv
import zipfile
from dataclasses import dataclass
from email.message import Message
from email.parser import Parser
from pathlib import Path

import psutil
import pytest

from conftest import TAG_ENV, ShmScope, tagged_processes

ROOT = Path(__file__).resolve().parent.parent
#: Where the project lives: [project.urls] and the index page's links point there.
REPOSITORY = "https://github.com/pytest-torchhang/pytest-torchhang"
RAW = "https://raw.githubusercontent.com/pytest-torchhang/pytest-torchhang/main/"
#: Markdown links and pictures: ``[text](target)``, ``![alt](target)``.
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")
#: The example run: one of examples/hangs/, the quickest to hang (a 3 s marker timeout).
HANG_EXAMPLE = "test_workers_forked_while_a_thread_holds_the_cache_lock"
#: Building twice (sdist, then the wheel from it) installs hatchling into two fresh environments.
BUILD_BOUND_S = 600
#: A fresh interpreter importing torch and torchvision on a loaded 2-core runner, a 3 s deadline,
#: the capture and the kill: about 10 s idle.
EXAMPLE_BOUND_S = 300


@dataclass
class Dists:
    sdist: Path
    wheel: Path

    def sdist_files(self) -> dict[str, bytes]:
        """The sdist's regular files, by path below its top folder."""
        with tarfile.open(self.sdist) as archive:
            files = {}
            for member in archive.getmembers():
                source = archive.extractfile(member) if member.isfile() else None
                if source is not None:
                    files[member.name.split("/", 1)[1]] = source.read()
            return files

    def wheel_files(self) -> dict[str, bytes]:
        with zipfile.ZipFile(self.wheel) as archive:
            return {name: archive.read(name) for name in archive.namelist()}

    def metadata(self) -> list[Message]:
        """The core metadata of both: the sdist's PKG-INFO and the wheel's METADATA."""
        wheel = self.wheel_files()
        (name,) = [n for n in wheel if n.endswith(".dist-info/METADATA")]
        texts = [self.sdist_files()["PKG-INFO"], wheel[name]]
        return [Parser().parsestr(text.decode()) for text in texts]


def _run(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=env, timeout=BUILD_BOUND_S
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def _build(out: Path) -> Dists:
    """The sdist from the checkout, then the wheel from the sdist, as ``python -m build`` makes
    them (a file the sdist lacks, the wheel lacks too), through the build backend itself: the
    build-system's requirements installed once into a folder of their own."""
    requires = re.search(
        r"^\[build-system\]\n(?:.*\n)*?requires = (\[.*\])$",
        (ROOT / "pyproject.toml").read_text(),
        re.M,
    )
    assert requires, "pyproject.toml has no [build-system] requires"
    backend = out / "backend"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--target",
            str(backend),
            *json.loads(requires.group(1)),
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(backend)}
    build = "import sys, hatchling.build as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    name = _run([sys.executable, "-c", build, "build_sdist", str(out)], cwd=ROOT, env=env)
    sdist = out / name.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        # the data filter where this Python has it (3.10.12, 3.11.4 and later)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(out / "unpacked", **safe)  # type: ignore[arg-type]
    (tree,) = (out / "unpacked").iterdir()
    name = _run([sys.executable, "-c", build, "build_wheel", str(out)], cwd=tree, env=env)
    return Dists(sdist, out / name.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist and wheel of this checkout, built once per session (pytest-xdist's workers
    share one build: the first one builds it, under a lock, the others wait for it)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _build(tmp_path_factory.mktemp("dist"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, above every worker's
    with open(shared / "dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # bounded: the builder's build is
        out = shared / "dist"
        if (out / "built").exists():
            sdist, wheel = (out / "built").read_text().splitlines()
            return Dists(Path(sdist), Path(wheel))
        out.mkdir(exist_ok=True)
        built = _build(out)
        (out / "built").write_text(f"{built.sdist}\n{built.wheel}\n")
        return built


def test_the_sdist_and_the_wheel_carry_the_mit_license(dists: Dists) -> None:
    license_text = (ROOT / "LICENSE").read_bytes()
    assert license_text.startswith(b"MIT License\n")
    assert b"Copyright (c) 2026 pytest-torchhang developers" in license_text
    assert dists.sdist_files()["LICENSE"] == license_text
    wheel = dists.wheel_files()
    (licenses,) = [n for n in wheel if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel[licenses] == license_text
    for metadata in dists.metadata():
        assert metadata["License-Expression"] == "MIT"
        assert metadata.get_all("License-File") == ["LICENSE"]


def test_the_project_urls_and_every_link_of_the_index_page_lead_to_the_repository(
    dists: Dists,
) -> None:
    readme = (ROOT / "README.md").read_text()
    relative = [(image, target) for image, target in LINK.findall(readme) if "://" not in target]
    assert relative, "the README has relative links (to docs/, bench/, the graph picture)"
    expected = [
        RAW + target
        if image
        else f"{REPOSITORY}/{'tree' if target.endswith('/') else 'blob'}/main/{target}"
        for image, target in relative
        if not target.startswith("#")
    ]
    for metadata in dists.metadata():
        urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
        assert urls["Homepage"] == urls["Source"] == REPOSITORY, urls
        assert urls["Issues"] == f"{REPOSITORY}/issues", urls
        assert all(url.startswith(REPOSITORY) for url in urls.values()), urls
        assert metadata["Description-Content-Type"] == "text/markdown"
        page = metadata.get_payload()
        assert isinstance(page, str)
        links = [target for _, target in LINK.findall(page)]
        left = [t for t in links if not t.startswith(("https://", "#"))]
        assert not left, f"relative links on the index page: {left}"
        assert [t for t in links if t in expected] == expected
        # the rest of the page is the README's own text
        assert LINK.sub("", page).strip() == LINK.sub("", readme).strip()
    # the repository keeps its relative links, for GitHub and a checkout
    assert dists.sdist_files()["README.md"].decode() == readme


def test_the_wheel_ships_the_example_suite_and_says_it_is_typed(dists: Dists) -> None:
    wheel = dists.wheel_files()
    examples = {
        path.relative_to(ROOT / "examples").as_posix(): path.read_bytes()
        for path in (ROOT / "examples").rglob("*")
        if path.is_file()
        and not {"__pycache__", ".pytest_cache", "torchhang-reports"} & set(path.parts)
    }
    shipped = {
        name.removeprefix("pytest_torchhang/examples/"): data
        for name, data in wheel.items()
        if name.startswith("pytest_torchhang/examples/")
    }
    assert shipped == examples
    assert "hangs/test_dataloader_lock_at_fork.py" in shipped
    assert "pytest_torchhang/py.typed" in wheel
    for metadata in dists.metadata():
        classifiers = metadata.get_all("Classifier") or []
        assert "Typing :: Typed" in classifiers
        assert any(c.startswith("Development Status :: ") for c in classifiers)


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv holding only the wheel, with torch and the rest of the dependencies from this
    interpreter's torch installation (a ``.pth``: a second torch install costs gigabytes)."""
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    torch = importlib.util.find_spec("torch")
    assert torch is not None and torch.origin is not None
    Path(site_packages, "dependencies.pth").write_text(f"{Path(torch.origin).parents[1]}\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return python


@pytest.mark.needs_torch  # the example session imports torch and torchvision
def test_the_installed_wheel_runs_an_example_hang_from_its_own_copy_of_the_suite(
    dists: Dists, tmp_path: Path
) -> None:
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("the example suite needs torchvision, which is not installed")
    python = _fresh_venv(tmp_path / "venv", dists.wheel)
    elsewhere = tmp_path / "elsewhere"  # no checkout in sight: the cwd is on sys.path with -m
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run(
        [str(python), "-c", "import pytest_torchhang; print(pytest_torchhang.__file__)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=60,
    )
    assert found.stdout.startswith(str(tmp_path / "venv")), found.stdout + found.stderr

    tag = env[TAG_ENV] = uuid.uuid4().hex
    shm = ShmScope(tag)
    command = [str(python), "-m", "pytest_torchhang", "examples", "-k", HANG_EXAMPLE]
    try:
        done = subprocess.run(
            shm.command(*command, "-p", "no:randomly", "-p", "no:cacheprovider"),
            capture_output=True,
            text=True,
            cwd=elsewhere,
            env=env,
            stdin=subprocess.DEVNULL,
            timeout=EXAMPLE_BOUND_S,
        )
        deadline = time.monotonic() + 10
        while (left := tagged_processes(tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        new_shm = shm.new_entries()
    finally:
        for proc in tagged_processes(tag):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shm.close()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-6000:]
    lines = out.splitlines()
    copied = (
        re.escape(str(tmp_path / "venv"))
        + r"/lib/python[\d.]+/site-packages/pytest_torchhang/examples"
    )
    assert any(re.match(f"the example suite, copied from {copied}: ", line) for line in lines), out
    assert any(
        re.fullmatch(r"rootdir: /.*/pytest-torchhang-[^/]+/examples", line) for line in lines
    )
    assert any(
        line.startswith("HANG after 3.")
        and f"::{HANG_EXAMPLE}: " in line
        and line.endswith("2 stuck in DataLoader worker __getitem__")
        for line in lines
    ), out[-6000:]
    assert any(line.startswith("hint: 2 DataLoader worker(s) wait for a lock.") for line in lines)
    assert any(line.startswith("cleanup: killed 2 process(es)") for line in lines), out[-6000:]
    assert re.search(r"^=+ 1 failed, \d+ deselected in ", out, re.M), out[-2000:]
    assert not left, f"processes left running: {left}"
    assert not new_shm, f"/dev/shm segments left: {new_shm}"
