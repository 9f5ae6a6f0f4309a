"""The demo's console output when the terminal is gone."""

import errno
import sys

import numpy as np
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


def test_rounds_that_closed_between_two_looks_each_get_their_line(tmp_path, capsys):
    # Seen under load (a paired `make test`): the traffic loop stalled for longer than a 1-second round,
    # two rounds closed between two looks at the round index, and the headless demo printed rounds
    # 2, 3, 4 but not 1. The rounds missed in between are printed from the rounds history, each with
    # the mixture deployed after the round before it, as the line of a round seen on time shows.
    from pasto.optimum import best_single
    from service.demo.groundtruth import arm_names, experiment_objective, load_demo_scenario, true_means
    from service.demo.setup import ensure_experiment
    from tests.client.conftest import make_server

    scenario = load_demo_scenario()
    objective, means, names = experiment_objective(scenario), true_means(scenario), arm_names(scenario)
    _, single_value = best_single(objective, means)
    live = make_server(tmp_path, scheduler=False)
    try:
        with live.client() as admin:
            name = ensure_experiment(admin, scenario, round_seconds=3600.0)
            # Some data (units hashed to their arms by the server), so that the updates move the mixture.
            admin.observe(name, [{"id": f"o{i}", "unit": f"u{i}", "round": 0,
                                  "values": {metric: 1.0 + i % 7 for metric in scenario.metrics}} for i in range(60)])
            for _ in range(3):
                admin.close_round(name)
            history = admin.rounds(name)
            capsys.readouterr()
            console.report_past_rounds(admin, name, 1, 2, objective, means, names, False, single_value)
            console.report_round(admin, name, 3, objective, means, names, False, single_value)
        lines = capsys.readouterr().out.splitlines()
    finally:
        live.stop()
    assert [int(line.split()[1].rstrip(":")) for line in lines] == [1, 2, 3], lines
    for line, entry in zip(lines, history[:3]):  # round i's line: the mixture deployed after round i - 1
        assert line == console._round_line(entry["index"] + 1, np.asarray(entry["deployed"]), objective, means,
                                           names, single_value)
