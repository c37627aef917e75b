"""The views of one hang model: Mermaid and Graphviz graphs, the Markdown section, ``show``."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_torchhang import __main__ as cli
from pytest_torchhang.report import views
from pytest_torchhang.report.model import HangReport
from pytest_torchhang.report.text import to_text

from .mermaid_flowchart import MermaidError, mermaid_blocks, parse

HERE = Path(__file__).parent
#: Real hangs recorded with the plugin (``--torch-hang-report-dir``), gzipped, not edited.
VIEWS_DATA = HERE / "recorded_views"
RECORDED = sorted(VIEWS_DATA.glob("*.json.gz")) + sorted((HERE / "data").glob("test_*.json"))


def load(path: Path) -> HangReport:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return HangReport.from_json(json.loads(raw))


def recorded(name: str) -> HangReport:
    return load(VIEWS_DATA / f"{name}.json.gz")


def saved(tmp_path: Path, name: str) -> Path:
    """A recorded report as the plain JSON file the plugin wrote."""
    path = tmp_path / f"{name}.json"
    path.write_bytes(gzip.decompress((VIEWS_DATA / f"{name}.json.gz").read_bytes()))
    return path


def roles(chart_nodes: dict[str, list[str]]) -> dict[str, str]:
    return {key: lines[0] for key, lines in chart_nodes.items()}


@pytest.mark.parametrize("path", RECORDED, ids=[p.name.split(".")[0] for p in RECORDED])
def test_every_recorded_hang_draws_a_valid_flowchart_with_every_process_in_a_box(
    path: Path,
) -> None:
    hang = load(path)
    chart = parse(views.to_mermaid(hang))
    graph = views.build_graph(hang)
    assert list(chart.nodes) == [n.key for n in graph.nodes]
    assert sorted(pid for n in graph.nodes for pid in n.pids) == sorted(
        p.pid for p in hang.processes
    )
    for node in graph.nodes:
        assert chart.nodes[node.key] == node.lines()


def test_a_dataloader_hang_draws_the_parent_waiting_on_each_worker_through_a_pipe() -> None:
    chart = parse(views.to_mermaid(recorded("dataloader_two_workers")))
    by_role = {lines[0]: key for key, lines in chart.nodes.items()}
    workers = [key for role, key in by_role.items() if role.startswith("DataLoader worker")]
    assert len(workers) == 2
    assert {(src, dst) for src, _, label, dst in chart.edges if label.startswith("pipe")} == {
        (by_role["pytest"], w) for w in workers
    }
    assert chart.classes["chainEnd"] == set(workers)  # the chain ends in the sleeping workers
    assert all(
        lines[-1] == "in __getitem__" for key, lines in chart.nodes.items() if key in workers
    )


def test_sixty_four_identical_workers_are_one_box() -> None:
    chart = parse(views.to_mermaid(recorded("dataloader_64_workers")))
    assert len(chart.nodes) == 2, chart.nodes
    worker = next(lines for lines in chart.nodes.values() if lines[0] != "pytest")
    assert worker[0] == "DataLoader worker 0-63/64 (dataset Stuck)"
    assert worker[1].startswith("64 processes: pid ") and worker[1].endswith(" +60 more")
    assert len(chart.edges) == 1


def test_sixty_four_distinct_processes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    hang = recorded("dataloader_64_workers")
    for n, proc in enumerate(hang.processes[1:]):
        proc.stuck_at = f"step_{n}"  # nothing to group: every worker stuck somewhere else
    chart = parse(views.to_mermaid(hang))
    assert len(chart.nodes) == views.MAX_NODES
    more = chart.nodes[views.MORE]
    assert more == [f"{65 - views.MAX_NODES + 1} more processes"]
    assert len(views.to_markdown(hang)) < 120_000


def test_two_processes_reading_each_others_pipe_are_drawn_as_a_cycle() -> None:
    chart = parse(views.to_mermaid(recorded("pipe_cycle")))
    assert set(chart.classes["inCycle"]) == set(chart.nodes)
    assert sorted(arrow for _, arrow, _, _ in chart.edges) == ["==>", "==>"]
    assert {label for _, _, label, _ in chart.edges} == {"pipe (read)"}


def test_a_parent_in_join_waits_for_its_child_through_wait4() -> None:
    chart = parse(views.to_mermaid(recorded("join_wait4")))
    (src, arrow, label, dst), *_ = chart.edges
    assert (chart.nodes[src][0], label, arrow) == ("pytest", "wait4", "-->")
    assert chart.nodes[dst][0] == "multiprocessing.Process(target=_sleeper)"
    assert chart.classes["chainEnd"] == {dst}


def test_a_rank_in_a_collective_waits_for_the_rank_that_never_started_it() -> None:
    path = HERE / "data" / "test_distributed_rank_never_reaches_the_collective.json"
    if not path.exists():
        pytest.skip(f"{path.name} is not recorded here")
    chart = parse(views.to_mermaid(load(path)))
    names = roles(chart.nodes)
    collective = [
        (names[s], label, names[d]) for s, _, label, d in chart.edges if "collective" in label
    ]
    assert [(s.split()[1], label, d.split()[1]) for s, label, d in collective] == [
        ("0/2", "collective barrier #1", "1/2")
    ]


@pytest.mark.parametrize("text", ['say "hi"', "a|b", "x[0]", "<lambda>", "#1; {k}", "end"])
def test_labels_keep_every_character_and_stay_valid(text: str) -> None:
    hang = recorded("join_wait4")
    hang.processes[1].role = text
    hang.processes[1].stuck_at = text
    chart = parse(views.to_mermaid(hang))
    lines = chart.nodes[f"p{hang.processes[1].pid}"]
    assert lines[0] == text and lines[-1] == f"in {text}"


@pytest.mark.parametrize(
    "line",
    [
        '    a["say "hi""]',  # a quote ends the label early
        '    a["x"]\n    a -->|"a|b"| a',  # a pipe ends the edge label early
        '    end["x"]',  # a keyword as an id
        '    a["x"]\n    a --> b',  # an edge without a label, to nobody
        '    a["x"]\n    class a red',  # a class never defined
        '    a["#1 x"]',  # a bare # starts an entity
    ],
)
def test_the_grammar_check_rejects_what_mermaid_would_misread(line: str) -> None:
    with pytest.raises(MermaidError):
        parse("flowchart LR\n" + line + "\n")


def test_the_dot_graph_is_what_graphviz_draws(tmp_path: Path) -> None:
    dot = views.to_dot(recorded("pipe_cycle"))
    assert dot.startswith("digraph hang {") and dot.rstrip().endswith("}")
    assert dot.count("->") == 2 and 'color="#b71c1c", penwidth=3' in dot
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: the syntax is checked by it where it is")
    svg = subprocess.run(
        ["dot", "-Tsvg"], input=dot, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "<svg" in svg and "Python child" in svg


def test_the_markdown_section_has_the_headline_hints_graph_and_the_full_text() -> None:
    hang = recorded("dataloader_two_workers")
    markdown = views.to_markdown(hang)
    assert markdown.startswith(f"### `{hang.headline}`\n")
    assert markdown.count("- **hint:** ") == len(hang.hints) >= 1
    (block,) = mermaid_blocks(markdown)
    assert parse(block).edges
    folded = markdown.split("<details>", 1)[1]
    assert f"```text\n{to_text(hang).rstrip()}\n```" in folded and "</details>" in folded


def test_hint_markup_is_escaped_outside_its_code_spans() -> None:
    assert views.markdown_text("a __init__ in `x[0]_y`") == r"a \_\_init\_\_ in `x[0]_y`"


def test_the_job_summary_gets_one_section_per_hang_and_a_bad_path_is_a_note(
    tmp_path: Path,
) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier steps\n")
    hangs = [recorded("dataloader_two_workers"), recorded("pipe_cycle")]
    for hang in hangs:
        assert views.append_job_summary(str(summary), hang) is None
    text = summary.read_text()
    assert text.startswith("# earlier steps\n")
    assert [line for line in text.splitlines() if line.startswith("### ")] == [
        f"### `{h.headline}`" for h in hangs
    ]
    problem = views.append_job_summary(str(tmp_path / "no" / "such" / "dir"), hangs[0])
    assert problem is not None and "could not be written" in problem


def test_a_full_job_summary_gets_headlines_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = tmp_path / "summary.md"
    monkeypatch.setattr(views, "SUMMARY_FULL_BYTES", 1000)
    hang = recorded("dataloader_two_workers")
    assert views.append_job_summary(str(summary), hang) is None
    assert summary.read_text() == f"- `{hang.headline}` (the job log has the report)\n"


# --- python -m pytest_torchhang show ------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(views.FORMATS))
def test_show_renders_a_saved_report_in_each_format(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = saved(tmp_path, "dataloader_two_workers")
    assert cli.main(["show", str(path), "--format", fmt]) == 0
    out = capsys.readouterr().out
    hang = recorded("dataloader_two_workers")
    expected = {
        "text": to_text(hang),
        "markdown": views.to_markdown(hang),
        "mermaid": views.to_mermaid(hang),
        "dot": views.to_dot(hang),
    }[fmt]
    assert out.rstrip("\n") == expected.rstrip("\n")


def test_show_prints_text_by_default_exactly_as_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["show", str(saved(tmp_path, "pipe_cycle"))]) == 0
    assert capsys.readouterr().out == to_text(recorded("pipe_cycle")) + "\n"


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    newer = json.loads(saved(tmp_path, "join_wait4").read_text())
    newer["schema_version"] = 99
    other = {"schema": "pytest-torchhang/hunt-summary", "schema_version": 1}
    unknown = {**json.loads(saved(tmp_path, "join_wait4").read_text()), "colour": "red"}
    files = {
        "missing": (tmp_path / "nope.json", "no such file"),
        "malformed": (tmp_path / "cut.json", "not JSON"),
        "newer": (tmp_path / "newer.json", "schema_version 99"),
        "other schema": (tmp_path / "hunt.json", "not a pytest-torchhang hang report"),
        "not an object": (tmp_path / "list.json", "not a pytest-torchhang hang report"),
        "unknown field": (tmp_path / "unknown.json", "not a hang report this version reads"),
    }
    files["malformed"][0].write_text('{"schema": "pytest-torch')
    files["newer"][0].write_text(json.dumps(newer))
    files["other schema"][0].write_text(json.dumps(other))
    files["not an object"][0].write_text("[1, 2]")
    files["unknown field"][0].write_text(json.dumps(unknown))
    return files


@pytest.mark.parametrize(
    "case", ["missing", "malformed", "newer", "other schema", "not an object", "unknown field"]
)
def test_show_refuses_a_bad_file_in_one_line_that_names_it(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, reason = _bad_inputs(tmp_path)[case]
    assert cli.main(["show", str(path)]) == cli.BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert str(path) in line and reason in line, line


def test_show_as_a_command_has_no_traceback(tmp_path: Path) -> None:
    # the one real command line of the fast tier: no torch, no pytest session, 0.1 s
    missing = tmp_path / "missing.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_torchhang", "show", str(missing), "--format", "mermaid"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == cli.BAD_INPUT and done.stdout == ""
    assert done.stderr == f"python -m pytest_torchhang show: {missing}: no such file\n"


def test_a_node_group_keeps_its_numbers_in_ranges() -> None:
    assert views._ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"
    hang = recorded("dataloader_64_workers")
    hang.processes = [p for p in hang.processes if not p.role.startswith("DataLoader worker 4/")]
    box = next(n for n in views.build_graph(hang).nodes if n.role.startswith("DataLoader"))
    assert box.role == "DataLoader worker 0-3, 5-63/64 (dataset Stuck)" and len(box.pids) == 63


def test_rendering_leaves_the_model_as_it_was() -> None:
    hang = recorded("dataloader_64_workers")
    before = dataclasses.asdict(hang)
    for fmt in views.FORMATS:
        views.render(hang, fmt)
    assert dataclasses.asdict(hang) == before
