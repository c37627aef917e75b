"""A plugin module warms its cache at import time in a thread and joins it; the thread imports the
plugin module (to read a setting), which is still being imported by the main thread: the thread waits
for the module's import lock, the main thread (holding it) waits for the thread."""

import importlib
import sys

PLUGIN = """
import threading

CACHE = {{}}
SIZE = 4

def warm():
    import {name}
    for i in range({name}.SIZE):
        CACHE[i] = i * i

t = threading.Thread(target=warm, name="cache-warmer")
t.start()
{join}
"""


def load(tmp_path, name, join):
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(name=name, join=join))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_plugin_warms_its_cache_at_import(tmp_path):
    plugin = load(tmp_path, "scoring_plugin_a", "t.join()")
    assert plugin.CACHE[3] == 9


def test_plugin_warms_its_cache_after_import(tmp_path):
    plugin = load(tmp_path, "scoring_plugin_b", "")
    plugin.t.join()
    assert plugin.CACHE[3] == 9
