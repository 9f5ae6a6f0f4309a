"""Signal dispositions for child processes that the tests stop with signals."""

from __future__ import annotations

import signal

#: What a terminal's job gets by default. A suite started in the background by a non-interactive shell
#: inherits SIGINT ignored, and one started under nohup SIGHUP ignored; ignored signals stay ignored
#: across exec, so a demo started from such a suite would never see the Ctrl-C or hang-up a test sends.
STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)


def as_in_a_terminal() -> None:
    """``preexec_fn`` (or a forked child's first call): the stop signals back to their default actions,
    whatever the test runner inherited."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
