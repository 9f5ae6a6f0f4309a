"""The live demo check: ``pasto demo`` for N rounds, each round's served mixture under the truth.

Runs ``pasto demo --headless`` in a fresh instance folder (its own SQLite database) for ``--rounds``
rounds, then reads the round history through the API and applies the demo's true means
(:mod:`service.demo.groundtruth`) to the mixture each round's traffic was served with (``probabilities``
of the round) and to the mixture deployed after its update. Prints one line per round: the served
mixture's true like rate and share rate against the two hard guardrails, the deployed mixture's, and
whether the served traffic held both; then the rounds after ``--after`` that broke one.

Usage: ``.venv/bin/python bench/demo_live.py --rounds 60 --round-seconds 2 --sessions-per-second 1500``
(about 2.5 minutes). Exit status 1 when a round after ``--after`` breaks a guardrail by more than
``--tolerance`` (relative to its threshold; 0 by default: strictly).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from pasto_client import Client
from service.demo.groundtruth import experiment_objective, load_demo_scenario, true_means


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_demo(folder: Path, args: argparse.Namespace, port: int) -> None:
    command = [sys.executable, "-m", "pasto.cli", "demo", "--headless", "--instance", str(folder),
               "--port", str(port), "--round-seconds", str(args.round_seconds), "--rounds", str(args.rounds),
               "--sessions-per-second", str(args.sessions_per_second), "--seed", str(args.seed)]
    with open(folder / "demo-output.txt", "w") as sink:
        finished = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if finished.returncode != 0:
        raise SystemExit(f"pasto demo failed ({finished.returncode}); its output:\n"
                         + (folder / "demo-output.txt").read_text()[-4000:])


def read_history(folder: Path) -> tuple[str, list[dict]]:
    """(experiment name, its rounds as ``GET .../rounds`` gives them), read after the demo stopped
    through the API of an app on the demo's database (the factory starts no scheduler)."""
    from service import create_app

    app = create_app({"PASTO_DATABASE_URL": f"sqlite:///{folder / 'pasto.sqlite'}"})
    tokens = json.loads((folder / "demo-tokens.json").read_text())
    client = app.test_client()
    headers = {"Authorization": f"Bearer {tokens['read']}"}
    experiments = client.get("/api/v1/experiments", headers=headers).get_json()["experiments"]
    name = [e["name"] for e in experiments if e["status"] != "stopped"][-1]
    rounds, since = [], 0
    while since is not None:
        page = client.get(f"/api/v1/experiments/{name}/rounds?since={since}", headers=headers).get_json()
        rounds.extend(page["rounds"])
        since = page["next_since"]
    return name, rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--round-seconds", type=float, default=2.0)
    parser.add_argument("--sessions-per-second", type=float, default=1500.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--after", type=int, default=10, help="rounds from this index on must hold (default 10)")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="allowed shortfall relative to the threshold (the simulator's acceptance uses 0.001)")
    parser.add_argument("--keep", type=Path, default=None, help="instance folder to use and keep")
    args = parser.parse_args(argv)

    scenario = load_demo_scenario()
    objective, means = experiment_objective(scenario), true_means(scenario)
    thresholds = objective.thresholds(means)
    rows = objective.guardrail_rows
    with tempfile.TemporaryDirectory(prefix="pasto-demo-live-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        run_demo(folder, args, port)
        name, rounds = read_history(folder)

    names = [g.metric for g in objective.guardrails]
    print(f"experiment {name}; thresholds " + ", ".join(f"{n} >= {c:.5f}" for n, c in zip(names, thresholds)))
    print("round  sessions  served " + "  ".join(f"{n:>10}" for n in names)
          + "   deployed " + "  ".join(f"{n:>10}" for n in names) + "  served watch  holds")
    broken = []
    for entry in rounds:
        if entry.get("applied_at") is None:
            continue
        served = np.asarray(entry["probabilities"], dtype=float)
        deployed = np.asarray(entry["deployed"], dtype=float)
        served_guarded = means[rows] @ served
        deployed_guarded = means[rows] @ deployed
        shortfall = (thresholds - served_guarded) / np.abs(thresholds)
        holds = bool(np.all(shortfall <= args.tolerance))
        if not holds and entry["index"] >= args.after:
            broken.append(entry["index"])
        print(f"{entry['index']:5d}  {int(sum(entry['counts'])):8d}        "
              + "  ".join(f"{v:10.5f}" for v in served_guarded) + "            "
              + "  ".join(f"{v:10.5f}" for v in deployed_guarded)
              + f"  {means[0] @ served:12.3f}  {'yes' if holds else 'NO'}")
    print(f"rounds from {args.after} on breaking a guardrail (tolerance {args.tolerance:g} of the threshold): "
          f"{broken or 'none'}")
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
