"""``python -m pytest_torchhang.monitor PYTEST_PID FD DUMP_DIR REPORT_DIR BOARD [--spare-root]``."""

import sys

from .process import main

sys.exit(main(sys.argv[1:]))
