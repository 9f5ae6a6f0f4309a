"""The demo's console output when the terminal is gone."""

import errno
import sys

import pytest

from service.demo import console
from service.demo.supervise import StopRequested


class _HungUpTerminal:
    """What stdout becomes once the terminal has gone away: every write fails with EIO."""

    def write(self, text: str) -> int:
        raise OSError(errno.EIO, "Input/output error")

    def flush(self) -> None:
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_round_line_to_a_hung_up_terminal_stops_the_demo_cleanly(monkeypatch, overwrite):
    # The terminal can go away before its SIGHUP arrives (seen under load in
    # test_closing_the_terminal_stops_the_demo_and_its_server): the write's EIO must stop the demo
    # like the SIGHUP, not escape as a traceback that leaves the server running.
    monkeypatch.setattr(sys, "stdout", _HungUpTerminal())
    with pytest.raises(StopRequested):
        console._print_round_line("round    3: deployed [...]", overwrite)
    print("later output goes nowhere")  # stdout was swapped for devnull: no second error
