"""The parent writes a large input to a filter's stdin before reading its stdout: the filter writes as
it reads, its stdout pipe fills, it stops reading stdin, and the parent's write blocks too."""

import subprocess
import sys

FILTER = "import sys\nfor line in sys.stdin: sys.stdout.write(line)"
PAYLOAD = "sample\n" * 200_000  # 1.4 MB, far more than two pipe buffers


def test_filter_a_large_payload_by_hand():
    child = subprocess.Popen(
        [sys.executable, "-c", FILTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child.stdin.write(PAYLOAD)
    child.stdin.close()
    out = child.stdout.read()
    child.wait()
    assert len(out) == len(PAYLOAD)


def test_filter_a_large_payload_with_communicate():
    child = subprocess.Popen(
        [sys.executable, "-c", FILTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    out, _ = child.communicate(PAYLOAD)
    assert len(out) == len(PAYLOAD)
