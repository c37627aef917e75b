"""Shared scenario builders: run a real pytest session with the plugin and check what it left."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from warm import SERVER_OF_THIS_PROCESS as WARM

pytest_plugins = ["pytester"]

TAG_ENV = "TORCHHANG_TEST_TAG"
SHM_DIR = Path("/dev/shm")
_SHM_PREFIXES = ("sem.mp-", "torch_", "psm_")
#: Runs the rest of the command line with /dev/shm replaced by ``$0`` (a directory on the same
#: tmpfs), in a mount namespace of its own: the bind is invisible to every other process.
_PRIVATE_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


#: Tests that import torch, or whose inner sessions do (node id prefixes; a test file can also
#: mark itself with ``pytestmark = pytest.mark.needs_torch``). The rest of the suite also runs
#: where torch is not installed: the fast tox environments, one per Python version.
NEEDS_TORCH = (
    "tests/test_dataloader_hangs.py::",
    "tests/test_distributed_hangs.py::",
    "tests/test_examples.py::",
    "tests/test_fixture_dataloader_distributed.py::",
    "tests/test_fixture_run.py::",
    "tests/test_diagnosis_rules.py::",
    "tests/test_fault_matrix.py::test_crashes_are_reported_as_crashes_at_once",
    "tests/test_fault_matrix.py::test_the_zygote_start_up",
    "tests/test_fixture_env.py::",
    "tests/test_ownership.py::test_module_scoped_persistent_workers",
    "tests/test_wide_fixtures.py::test_persistent_dataloader_workers",
    "tests/test_reports.py::test_junit_xml_json_files",
    "tests/test_reports.py::test_under_xdist_the_controller",
    "tests/test_reports.py::test_the_report_and_json_carry_wait_for_edges",
    "tests/test_devices.py::test_detection_and_skipping_neither_import_torch",
    "tests/test_devices.py::test_the_report_header_shows_torch",
    "tests/test_devices.py::test_the_torch_build_is_read_without_importing_torch",
    "tests/test_bench.py::",
    "tests/test_stall.py::",
    "tests/test_diagnosis_corpus.py::",
    "tests/test_reports.py::",
    "tests/test_session_safety.py::test_ctrl_c",
    "tests/test_session_safety.py::test_a_tmpdir_with_a_space",
    "tests/test_session_safety.py::test_a_runner_child_answers",
)

_HOGS = pytest.StashKey[list[subprocess.Popen[bytes]]]()
_HOG = "while True: pass"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs",
        type=int,
        default=0,
        metavar="N",
        help="Keep N CPU-bound processes running beside the suite, as on a busy CI runner "
        "(tox -e stress runs it with 2)",
    )


#: Test files whose tests share batched inner sessions (``batch_runner``): under pytest-xdist
#: each runs whole on one worker, so its batch runs once. (pytest-xdist's own ``--dist
#: loadgroup`` does not group under pytest 9: it renames ``item._nodeid``, which pytest 9.2 no
#: longer reads; seen with pytest-xdist 3.8.)
BATCHED = (
    "tests/test_asyncio_hangs.py",
    "tests/test_diagnosis_corpus.py",
    "tests/test_diagnosis_rules.py",
    "tests/test_hunt_races.py",
    "tests/test_interaction_matrix.py",
    "tests/test_other_plugins.py",
    "tests/test_user_world.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist load`` with each file of ``BATCHED`` one unit of work; every other test is a
    unit of its own, as under ``load``."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class BatchedFiles(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file in BATCHED else nodeid

    return BatchedFiles(config, log)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def pytest_configure(config: pytest.Config) -> None:
    hogs = config.getoption("cpu_hogs")
    if hogs < 0:
        raise pytest.UsageError(f"--cpu-hogs must be a number of processes >= 0, got {hogs}")
    config.addinivalue_line(
        "markers", "needs_torch: the test (or its inner session) imports torch (set by conftest)"
    )
    config.addinivalue_line(
        "markers",
        "cold_start: the test's inner sessions start a fresh interpreter (start-up is what it "
        "looks at), never the warm server (tests/warm.py)",
    )
    if hasattr(config, "workerinput"):  # pytest-xdist: the controller runs them, once
        return
    config.stash[_HOGS] = [
        subprocess.Popen([sys.executable, "-c", _HOG], preexec_fn=_die_with_parent)
        for _ in range(hogs)
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if item.nodeid.startswith(NEEDS_TORCH):
            item.add_marker(pytest.mark.needs_torch)
        if not have_torch and item.get_closest_marker("needs_torch") is not None:
            item.add_marker(pytest.mark.skip(reason="needs torch, which is not installed"))


def pytest_unconfigure(config: pytest.Config) -> None:
    WARM.close()
    for hog in config.stash.get(_HOGS, []):
        hog.kill()
        hog.wait()


def pytest_report_header(config: pytest.Config) -> list[str]:
    hogs = config.stash.get(_HOGS, [])
    shm = (
        "private per inner session"
        if private_shm_supported()
        else "shared (unopened new entries count)"
    )
    lines = [f"inner sessions: /dev/shm {shm}"]
    if hogs:
        lines.append(
            f"cpu hogs: {len(hogs)} running beside the suite (pids {', '.join(str(h.pid) for h in hogs)})"
        )
    return lines


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (everything a session started)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
    return found


@functools.cache
def private_shm_supported() -> bool:
    """Whether an inner session can get a /dev/shm of its own (root, unshare and mount)."""
    if not SHM_DIR.is_dir() or not (shutil.which("unshare") and shutil.which("mount")):
        return False
    probe = tempfile.mkdtemp(prefix="torchhang-tests-probe-", dir=SHM_DIR)
    try:
        command = ["unshare", "--mount", "sh", "-c", _PRIVATE_SHM, probe, "touch", "/dev/shm/x"]
        done = subprocess.run(command, capture_output=True, timeout=30)
        return done.returncode == 0 and os.listdir(probe) == ["x"]
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _shm_names(directory: Path) -> set[str]:
    try:
        return {n for n in os.listdir(directory) if n.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


def _open_by_anyone(directory: Path, names: set[str]) -> set[str]:
    """Which of ``names`` a live process has open or mapped (matched by inode, as glibc's
    sem_open maps a temporary name and then renames it)."""
    by_inode = {}
    for name in names:
        with contextlib.suppress(OSError):
            by_inode[(directory / name).stat().st_ino] = name
    used = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    inode = os.stat(f"/proc/{proc.pid}/fd/{fd}").st_ino
                    if inode in by_inode:
                        used.add(by_inode[inode])
            with open(f"/proc/{proc.pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    inode = int(fields[4]) if len(fields) == 6 else 0
                    if "/dev/shm" in fields[-1] and inode in by_inode:
                        used.add(by_inode[inode])
    return used


class ShmScope:
    """The /dev/shm entries one inner session created.

    Where the machine allows it (root), the session runs in a mount namespace whose /dev/shm is
    a fresh directory of the real one: whatever appears there is the session's, whatever else
    runs on the machine (a parallel pytest-xdist worker, another program). Elsewhere, new entries
    of the machine-wide /dev/shm that no live process has open are counted: a leak is by
    definition open by nobody, while another program's live segment is open by that program.
    """

    def __init__(self, tag: str) -> None:
        self.private = private_shm_supported()
        if self.private:
            self.directory = Path(tempfile.mkdtemp(prefix=f"torchhang-tests-{tag}-", dir=SHM_DIR))
            self.before: set[str] = set()
        else:
            self.directory = SHM_DIR
            self.before = _shm_names(SHM_DIR)

    def command(self, *argv: str) -> tuple[str, ...]:
        """``argv`` run with this scope's /dev/shm."""
        if not self.private:
            return argv
        return ("unshare", "--mount", "sh", "-c", _PRIVATE_SHM, str(self.directory), *argv)

    def new_entries(self) -> list[str]:
        new = _shm_names(self.directory) - self.before
        if new and not self.private:
            new -= _open_by_anyone(self.directory, new)
        return sorted(new)

    def close(self) -> None:
        if self.private:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Session:
    """A finished inner pytest session and what it left behind."""

    result: pytest.RunResult
    wall_s: float
    leftovers: list[str]
    new_shm: list[str]
    #: multiprocessing temp dirs (``pymp-*``: a Manager's listener) left in the session's TMPDIR
    new_tmp: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.result.stdout.str() + "\n" + self.result.stderr.str()

    def assert_clean(self) -> None:
        assert not self.leftovers, f"processes left running: {self.leftovers}"
        assert not self.new_shm, f"/dev/shm segments left: {self.new_shm}"
        assert not self.new_tmp, f"multiprocessing temp dirs left in TMPDIR: {self.new_tmp}"

    def passed(self, test_id: str) -> bool:
        """Whether the test ``test_id`` (``file.py::name``) passed; the session ran with ``-v``
        or ``-rA``."""
        out = self.result.stdout.str()
        return f"{test_id} PASSED" in out or f"PASSED {test_id}" in out

    def report_of(self, test_name: str) -> str:
        """The failure text of one test in the FAILURES section, or its hang's in HANGS."""
        out = self.result.stdout.str()
        match = re.search(rf"_ ((?:ERROR|HANG|STALL) at \w+ of )?{re.escape(test_name)} _", out)
        assert match, f"no failure section for {test_name}"
        start = match.start()
        end = out.find("\n____", start + 1)
        summary = out.find("====", start + 1)
        end = min(x for x in (end, summary, len(out)) if x != -1)
        return out[start:end]


class GuardedRunner:
    """Writes test files into a pytester dir and runs them in a subprocess pytest session."""

    def __init__(
        self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, warm: bool = True
    ) -> None:
        self.pytester = pytester
        self.monkeypatch = monkeypatch
        self.warm = warm

    def run(
        self,
        *args: str,
        timeout: float | None = 2,
        wait_s: float = 180,
        grace_s: float = 10,
        stdin: bytes | None = None,
        python: str = sys.executable,
        warm: bool | None = None,
    ) -> Session:
        """``warm``: start the session from the warm server (tests/warm.py) where that is
        faithful; the default is the test's (``cold_start`` marker: never)."""
        tag = uuid.uuid4().hex
        self.monkeypatch.setenv(TAG_ENV, tag)
        warm = self.warm if warm is None else warm
        return self._run(args, tag, None, timeout, wait_s, grace_s, stdin, python, warm)

    def run_many(
        self,
        sessions: dict[str, tuple[str, ...]],
        *,
        at_once: int = 3,
        dirs: dict[str, Path] | None = None,
        **options: object,
    ) -> dict[str, Session]:
        """Run one inner session per entry (its pytest arguments), up to ``at_once`` of them
        at the same time, each with a tag, a TMPDIR and a /dev/shm of its own; ``options`` as
        :meth:`run` takes them (``python`` and ``warm`` aside: these start cold, in fresh
        interpreters, as the warm server runs one session at a time).

        For sessions that mostly wait (deadlines, hangs): the machine's cores then work on the
        others' start-up and captures meanwhile. The sessions run in pytester's directory,
        sharing its files (each naming its own files or tests, and its own report directory),
        or each in its own directory of ``dirs`` (by name: a file name the checks expect in
        every session).
        """
        from concurrent.futures import ThreadPoolExecutor

        unknown = set(options) - {"timeout", "wait_s", "grace_s", "stdin"}
        assert not unknown, f"run_many takes no {sorted(unknown)}"
        timeout = options.get("timeout", 2)
        wait_s = options.get("wait_s", 180)
        grace_s = options.get("grace_s", 10)
        stdin = options.get("stdin")
        assert timeout is None or isinstance(timeout, (int, float))
        assert isinstance(wait_s, (int, float)) and isinstance(grace_s, (int, float))
        assert stdin is None or isinstance(stdin, bytes)
        base = dict(os.environ)

        def one(name: str, args: tuple[str, ...]) -> Session:
            cwd = (dirs or {}).get(name, self.pytester.path)
            tag = uuid.uuid4().hex
            tmpdir = tempfile.mkdtemp(prefix="s-", dir=base.get("TMPDIR"))
            # as pytester's popen does: the test files' directory first on the path
            path = os.pathsep.join(filter(None, [str(cwd), base.get("PYTHONPATH", "")]))
            env = {**base, TAG_ENV: tag, "TMPDIR": tmpdir, "PYTHONPATH": path}
            try:
                return self._run(
                    args, tag, env, timeout, wait_s, grace_s, stdin, sys.executable, False, cwd
                )
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)

        with ThreadPoolExecutor(max_workers=max(1, at_once)) as pool:
            futures = {name: pool.submit(one, name, args) for name, args in sessions.items()}
            return {name: future.result() for name, future in futures.items()}

    def _run(
        self,
        args: tuple[str, ...],
        tag: str,
        env: dict[str, str] | None,
        timeout: float | None,
        wait_s: float,
        grace_s: float,
        stdin: bytes | None,
        python: str,
        warm: bool,
        cwd: Path | None = None,
    ) -> Session:
        """One session; ``env``: its whole environment, run cold in pytester's directory (for
        sessions run at the same time), else this process's environment, as pytester runs."""
        shm = ShmScope(tag)
        extra = [f"--torch-hang-timeout={timeout}"] if timeout is not None else []
        # as runpytest_subprocess does, plus the private /dev/shm and stdin (a debugger needs it)
        basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=cwd or self.pytester.path)
        tmpdir = Path((env or os.environ).get("TMPDIR") or tempfile.gettempdir())
        tmp_before = _mp_temp_dirs(tmpdir)
        command = shm.command(
            python, "-mpytest", f"--basetemp={basetemp}", "-p", "no:cacheprovider"
        )
        start = time.monotonic()
        try:
            if env is not None:
                result = _run_with_env(
                    [*command, *extra, *args], cwd or self.pytester.path, env, wait_s, stdin
                )
            elif warm and WARM.accepts(python, dict(os.environ)):
                result = WARM.run(
                    self.pytester,
                    [f"--basetemp={basetemp}", "-p", "no:cacheprovider", *extra, *args],
                    stdin=stdin,
                    shm=shm.directory if shm.private else None,
                    timeout=wait_s,
                )
            else:
                result = self.pytester.run(
                    *command,
                    *extra,
                    *args,
                    timeout=wait_s,
                    stdin=self.pytester.CLOSE_STDIN if stdin is None else stdin,
                )
            wall = time.monotonic() - start
            # Session helpers (resource_tracker, forkserver) exit by themselves once pytest is
            # gone: give them a moment, then anything of this session still alive is a leak.
            deadline = time.monotonic() + grace_s
            while (left := tagged_processes(tag)) and time.monotonic() < deadline:
                time.sleep(0.1)
            while (new_shm := shm.new_entries()) and time.monotonic() < deadline:
                time.sleep(0.1)
            new_tmp = sorted(_mp_temp_dirs(tmpdir) - tmp_before)
            leftovers = []
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    leftovers.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        finally:
            for proc in tagged_processes(tag):  # never let one test's leak poison the next
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            shm.close()
        return Session(result, wall, leftovers, new_shm, new_tmp)


def _run_with_env(
    argv: list[str], cwd: Path, env: dict[str, str], wait_s: float, stdin: bytes | None
) -> pytest.RunResult:
    """``argv`` in ``cwd`` with ``env``, as ``pytester.run`` runs it (which takes neither)."""
    start = time.monotonic()
    with tempfile.TemporaryFile(dir=cwd) as out, tempfile.TemporaryFile(dir=cwd) as err:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )
        try:
            proc.communicate(stdin, timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise pytest.Pytester.TimeoutExpired(
                f"{wait_s} second timeout expired running: {argv}"
            ) from None
        lines = []
        for stream in (out, err):
            stream.seek(0)
            lines.append(stream.read().decode("utf8", errors="replace").splitlines())
    for line in lines[0]:
        print(line)  # as pytester echoes a session's output: pytest shows it on failure
    for line in lines[1]:
        print(line, file=sys.stderr)
    ret: int | pytest.ExitCode = proc.returncode
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(proc.returncode)
    return pytest.RunResult(ret, lines[0], lines[1], time.monotonic() - start)


def _mp_temp_dirs(directory: Path) -> set[str]:
    """multiprocessing's temp dirs in ``directory`` (``util.get_temp_dir``: ``pymp-*``)."""
    try:
        return {name for name in os.listdir(directory) if name.startswith("pymp-")}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _inner_sessions_as_ours(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inner sessions run without pytest-randomly (a test extra), as the outer one does, and with
    pytest-asyncio's loop scope set (else it warns in every session); a test of the plugins users
    run enables randomly explicitly."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # which clears PYTEST_ADDOPTS: set it after
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if "no:randomly" not in addopts:
        ours = "-p no:randomly -o asyncio_default_fixture_loop_scope=function"
        monkeypatch.setenv("PYTEST_ADDOPTS", f"{addopts} {ours}".strip())


def _inner_environment(monkeypatch: pytest.MonkeyPatch) -> str:
    """Set the environment an inner session starts with; return its TMPDIR (the caller removes
    it)."""
    monkeypatch.delenv("PYTEST_TORCH_HANG_TIMEOUT", raising=False)
    # An inner session starts as on a fresh machine, whatever an in-process session of another
    # test left in this process's environment (the dump hook's variables).
    monkeypatch.delenv("PYTEST_TORCH_HANG_DUMP_DIR", raising=False)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    site = os.path.join("pytest_torchhang", "inject", "site")
    kept = [p for p in paths if p and not p.endswith(site)]
    if kept != [p for p in paths if p]:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(kept))
    # A TMPDIR of its own (short: a unix socket's path is at most 107 bytes), so that what an
    # inner session leaves there is its own; a test may set another.
    tmpdir = tempfile.mkdtemp(prefix="th-")
    monkeypatch.setenv("TMPDIR", tmpdir)
    return tmpdir


@pytest.fixture
def guarded(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[GuardedRunner]:
    """Run inner pytest sessions with pytest-torchhang and collect what they left behind."""
    tmpdir = _inner_environment(monkeypatch)
    cold = request.node.get_closest_marker("cold_start") is not None
    yield GuardedRunner(pytester, monkeypatch, warm=not cold)
    shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.contextmanager
def batch_runner(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GuardedRunner]:
    """A :class:`GuardedRunner` for a module-scoped (or wider) fixture: one inner session that
    many tests share, each reading its own report from it.

    Most of the end-to-end tier's time is waiting for deadlines; one session with N hanging
    tests pays pytest's (and torch's) start-up once, and each outer test checks its own
    scenario's report (``Session.report_of``, ``Session.passed``), so a check still fails when
    its behaviour breaks, and still fails alone. Usage, in a test module (listed in
    ``BATCHED``, so that its tests share one worker)::

        @pytest.fixture(scope="module")
        def batch(request, tmp_path_factory) -> Session:
            with batch_runner(request, tmp_path_factory) as guarded:
                guarded.pytester.makepyfile(test_a=A, test_b=B)  # distinct test names
                return guarded.run("test_a.py", "test_b.py", "-v", timeout=2)

        def test_a_hangs_with_its_hint(batch: Session) -> None:
            assert_hang(batch, "test_a_hangs", "hint: *")

    Put scenarios that leave something behind in the process (a thread, a handler) last, by
    naming the files in order. Scenarios that need sessions of different settings (options, a
    deadline source, xdist) share one fixture too: ``guarded.run_many({name: args, ...})`` runs
    them a few at a time and each test reads ``sessions[name]`` (see test_interaction_matrix.py,
    test_diagnosis_corpus.py); keep a session whose timing is fragile under load (a zygote
    importing torch under a short deadline) alone (``at_once=1``).

    The environment and working directory are those of ``guarded`` inside the ``with`` block
    and restored after it; the session's files stay. Under pytest-xdist's ``-n`` (``--dist
    load``, the default) a file of ``BATCHED`` runs whole on one worker
    (``pytest_xdist_make_scheduler``); under another ``--dist``, each worker that runs some of
    its tests runs its own copy of the batch: slower, never wrong.
    """
    monkeypatch = pytest.MonkeyPatch()
    scope = _WiderRequest(request)
    try:
        pytester = pytest.Pytester(scope, tmp_path_factory, monkeypatch, _ispytest=True)  # type: ignore[arg-type]
        ours = "-p no:randomly -o asyncio_default_fixture_loop_scope=function"
        monkeypatch.setenv("PYTEST_ADDOPTS", ours)  # as _inner_sessions_as_ours does
        tmpdir = _inner_environment(monkeypatch)
        try:
            cold = request.node.get_closest_marker("cold_start") is not None
            yield GuardedRunner(pytester, monkeypatch, warm=not cold)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        for finalizer in reversed(scope.finalizers):  # Pytester's: sys.modules, sys.path, env
            finalizer()
        monkeypatch.undo()


class _WiderRequest:
    """What ``pytest.Pytester`` reads of its request, for a fixture of a wider scope than a
    test's (whose ``request.function`` raises); its clean-up runs when the batch is done."""

    function = None

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.node = request.node
        self.config = request.config
        self.finalizers: list[Callable[[], object]] = []

    def addfinalizer(self, finalizer: Callable[[], object]) -> None:
        self.finalizers.append(finalizer)


def assert_hang(session: Session, test_name: str, *expected: str) -> str:
    """The test failed as a hang and its report holds ``expected`` lines (fnmatch patterns)."""
    report = session.report_of(test_name)
    lines = report.splitlines()
    first = lines[2] if lines[1].startswith("[gw") else lines[1]  # xdist names the worker first
    assert first.startswith("HANG after "), report[:2000]
    missing = [pattern for pattern in expected if not _matches(report, pattern)]
    assert not missing, f"missing {missing} in:\n{report[:6000]}"
    return report


def _matches(text: str, pattern: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(line, pattern) for line in text.splitlines())
