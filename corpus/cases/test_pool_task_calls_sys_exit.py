"""A Pool task calls sys.exit() on bad input (a command-line helper reused as a library function):
SystemExit is not an Exception, so the pool worker does not send it back as the task's error; the
worker process exits, the Pool replaces it, and the task's result is never produced."""

import multiprocessing
import sys

CTX = multiprocessing.get_context("fork")


def parse_config(text, exit_on_error=True):
    try:
        return dict(item.split("=") for item in text.split(","))
    except ValueError:
        if exit_on_error:
            sys.exit(f"bad config: {text!r}")  # what the CLI entry point does
        raise


def parse_config_raising(text):
    return parse_config(text, exit_on_error=False)


def test_parse_configs_with_one_bad_entry():
    with CTX.Pool(2) as pool:
        results = pool.map(parse_config, ["a=1,b=2", "c=3", "broken"])
    assert len(results) == 3


def test_parse_configs_with_one_bad_entry_raising():
    with CTX.Pool(2) as pool:
        try:
            pool.map(parse_config_raising, ["a=1,b=2", "c=3", "broken"])
        except ValueError:
            return
    raise AssertionError("the bad entry should have raised")
