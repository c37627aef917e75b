"""A request/response exchange with a filter program over pipes: the filter's output goes to a pipe, so
its C stdio block-buffers the answer while it waits for the next request, and the parent's readline()
waits for an answer that is still inside the child."""

import shutil
import subprocess


def ask(unbuffered):
    cmd = ["tr", "a-z", "A-Z"]
    if unbuffered:
        cmd = [shutil.which("stdbuf") or "stdbuf", "-o0", *cmd]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdin.write("ping\n")
        child.stdin.flush()
        return child.stdout.readline().strip()
    finally:
        child.stdin.close()
        child.wait()


def test_ask_the_normaliser():
    assert ask(unbuffered=False) == "PING"


def test_ask_the_normaliser_unbuffered():
    assert ask(unbuffered=True) == "PING"
