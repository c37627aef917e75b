"""subprocess.run(capture_output=True) of a launcher that starts a background server: the launcher
exits at once, but the server inherited the stdout pipe, so reading to EOF never ends."""

import subprocess
import sys

SERVER = "import time\nwhile True: time.sleep(1)"


def launcher(detach_output):
    redirect = ">/dev/null 2>&1" if detach_output else ""
    return f"{sys.executable} -c '{SERVER}' {redirect} & echo started"


def test_start_background_server():
    done = subprocess.run(["sh", "-c", launcher(False)], capture_output=True, text=True)
    assert done.stdout.strip() == "started"


def test_start_background_server_with_its_output_detached():
    done = subprocess.run(["sh", "-c", launcher(True)], capture_output=True, text=True)
    assert done.stdout.strip() == "started"
