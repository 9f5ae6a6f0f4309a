"""Executable documentation: the shell, Python and HTTP examples of README.md and docs/*.md, run verbatim.

:func:`extract_examples` finds every fenced block whose info string is ``sh``, ``bash``, ``shell``,
``console``, ``python`` (``py``, ``python3``) or ``http``. A block that cannot run here carries a marker on the line right before its
fence (blank lines between are allowed)::

    <!-- doctest: skip (needs PostgreSQL at an operator's host) -->

and is counted as skipped; the reason is required. Every other block is run by :class:`DocRunner`:

* ``sh``/``bash``/``shell``: the block's text, as it stands, by ``bash -e`` in a shadow checkout
  (a temporary directory with a symlink to each top-level entry of the repository, so
  ``.venv/bin/pasto`` and ``tests/...`` resolve while ``instance/`` and output files stay out of the
  worktree). The blocks of one markdown file share their exported environment, in document order,
  as a reader pasting them into one terminal would.
* ``console``: the lines after a ``$ `` prompt (with their ``\\`` continuations), the rest is output.
* ``python``: the block's text, as it stands, in one Python interpreter per markdown file (the
  test's own, in the shadow checkout, with the shared environment at the file's first Python block):
  the blocks of a file share their names, as a reader's session would. The placeholders a reader
  replaces, ``<ingest token>``, ``<read token>`` and ``<admin token>``, stand for the live server's
  tokens, and the documentation's local address goes to the live server (as for ``curl`` below).
* ``http``: a request line (``POST /api/v1/... HTTP/1.1``), headers, a blank line and a body,
  ``$VAR``/``${VAR}`` expanded from the shared environment, sent to the live server.

``curl`` is a shim on ``PATH`` that calls the real curl with ``--fail-with-body`` and records every
answer of status 400 or more, so an example that drifts from the API fails even inside a pipeline
(``curl ... | python3 -m json.tool``). Addresses the documentation uses for a local server
(``http://127.0.0.1:8000``, ``http://localhost:8000``) are sent to the live server's port instead:
the docs describe the default port, and tests must not take a fixed one.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import requests

#: Info strings of the fenced blocks that are examples to run.
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell"})
PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
RUNNABLE_LANGUAGES = SHELL_LANGUAGES | PYTHON_LANGUAGES | {"console", "http"}
#: Placeholders of the documentation's Python examples -> the environment variable holding the value.
PLACEHOLDERS = {"<ingest token>": "INGEST", "<read token>": "READ", "<admin token>": "ADMIN"}
#: How long one block may take: README's simulator block needs ~8 s of CPU (1,000 runs of setup A,
#: 4 x 50 rounds of setup B), which can take minutes of wall time on a 2-core machine shared by busy
#: sessions; the limit sits just under pytest's per-test timeout (600 s, pyproject.toml) so a hang is
#: reported here.
BLOCK_TIMEOUT_SECONDS = 540.0
DOCUMENTED_PORT = 8000

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(?P<directive>[a-z-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")


class MarkerError(ValueError):
    """A ``<!-- doctest: ... -->`` marker the harness does not understand, or one without its reason."""


@dataclass(frozen=True)
class Example:
    """One fenced block: ``path`` (relative to the repository), 1-based ``line`` of its opening fence,
    ``language`` (the info string), ``text`` (dedented), and ``skip_reason`` (None: it runs)."""

    path: str
    line: int
    language: str
    text: str
    skip_reason: str | None = None

    @property
    def runnable(self) -> bool:
        return self.skip_reason is None

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.language})"


def extract_examples(markdown: str, path: str) -> list[Example]:
    """Every ``sh``/``bash``/``shell``/``console``/``python``/``http`` fenced block of ``markdown``, in order."""
    lines = markdown.splitlines()
    examples: list[Example] = []
    position = 0
    while position < len(lines):
        opening = _FENCE.match(lines[position])
        if not opening:
            position += 1
            continue
        indent, fence, language = opening["indent"], opening["fence"], opening["info"].lower()
        body: list[str] = []
        end = position + 1
        while end < len(lines):
            stripped = lines[end].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(lines[end][len(indent):] if lines[end].startswith(indent) else lines[end].lstrip())
            end += 1
        if language in RUNNABLE_LANGUAGES:
            examples.append(Example(path, position + 1, language, "\n".join(body) + "\n",
                                    _skip_reason(lines, position, path)))
        position = end + 1
    return examples


def _skip_reason(lines: list[str], fence_index: int, path: str) -> str | None:
    previous = fence_index - 1
    while previous >= 0 and not lines[previous].strip():
        previous -= 1
    if previous < 0 or "doctest" not in lines[previous]:
        return None
    marker = _MARKER.match(lines[previous])
    if marker is None or marker["directive"] != "skip":
        raise MarkerError(f"{path}:{previous + 1}: the marker {lines[previous].strip()!r} is not "
                          "'<!-- doctest: skip (reason) -->', the only one the harness knows.")
    reason = (marker["reason"] or "").strip()
    if not reason:
        raise MarkerError(f"{path}:{previous + 1}: a doctest skip marker must say why the block cannot run, "
                          "as '<!-- doctest: skip (reason) -->'.")
    return reason


def documentation_files(root: Path) -> list[Path]:
    """README.md and every docs/*.md of the repository at ``root``, sorted."""
    return [path for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if path.is_file()]


def console_commands(text: str) -> str:
    """The commands of a ``console`` block: lines after ``$ `` with their backslash continuations."""
    commands: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing:
            commands.append(line)
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue
        continuing = line.rstrip().endswith("\\")
    return "\n".join(commands) + "\n"


_CURL_SHIM = """#!/bin/bash
# pasto doc-test shim: the real curl, failing on HTTP errors (recorded for the harness), with the
# documentation's local address sent to the live server.
args=()
for arg in "$@"; do
  arg="${arg//:\\/\\/127.0.0.1:%(port)d/:\\/\\/127.0.0.1:%(live_port)d}"
  arg="${arg//:\\/\\/localhost:%(port)d/:\\/\\/127.0.0.1:%(live_port)d}"
  args+=("$arg")
done
%(curl)s --fail-with-body "${args[@]}"
status=$?
if [ $status -eq 22 ]; then
  echo "curl $* answered an HTTP error (status >= 400)" >> "$DOCTEST_HTTP_FAILURES"
fi
exit $status
"""


@dataclass
class BlockResult:
    example: Example
    returncode: int
    output: str
    http_failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.http_failures

    def describe(self) -> str:
        failures = "".join(f"\n  {failure}" for failure in self.http_failures)
        return (f"{self.example}: exit status {self.returncode}{failures}\n--- block ---\n{self.example.text}"
                f"--- output (last 3000 characters) ---\n{self.output[-3000:]}")


class DocRunner:
    """Runs the examples of one markdown file in order, sharing their exported environment.

    ``environment`` is what the reader is assumed to have set (the live server's ``PASTO`` URL,
    tokens, ``PASTO_DATABASE_URL``...); ``repository`` is shadowed into ``workdir``.
    """

    def __init__(self, repository: Path, workdir: Path, environment: Mapping[str, str], live_url: str,
                 bin_dirs: Iterable[Path] = ()) -> None:
        self.live_url = live_url.rstrip("/")
        self.checkout = workdir / "checkout"
        self.checkout.mkdir(parents=True)
        for entry in repository.iterdir():
            if entry.name not in {"instance", ".git"} and not entry.name.endswith(".sqlite"):
                (self.checkout / entry.name).symlink_to(entry)
        self._state = workdir / "environment"
        self._failures = workdir / "http-failures"
        shim_dir = workdir / "shims"
        shim_dir.mkdir()
        curl = shutil_which("curl")
        live_port = int(self.live_url.rsplit(":", 1)[1])
        (shim_dir / "curl").write_text(_CURL_SHIM % {"port": DOCUMENTED_PORT, "live_port": live_port,
                                                      "curl": shlex.quote(curl)})
        (shim_dir / "curl").chmod(0o755)
        path = os.pathsep.join([str(shim_dir), *map(str, bin_dirs), environment.get("PATH", os.defpath)])
        self.environment = {**environment, "PATH": path, "DOCTEST_HTTP_FAILURES": str(self._failures)}
        self._python: subprocess.Popen | None = None
        self._python_executable = next((str(Path(d) / "python") for d in bin_dirs if (Path(d) / "python").exists()),
                                       sys.executable)

    def close(self) -> None:
        """Stop the file's Python interpreter, if a Python block started one."""
        if self._python is not None:
            self._python.stdin.close()
            try:
                self._python.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._python.kill()
                self._python.wait()
            self._python = None

    def __enter__(self) -> "DocRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(self, example: Example) -> BlockResult:
        if not example.runnable:
            raise ValueError(f"{example} is marked skip: {example.skip_reason}")
        self._failures.write_text("")
        if example.language == "http":
            result = self._run_http(example)
        elif example.language in PYTHON_LANGUAGES:
            result = self._run_python(example)
        else:
            script = example.text if example.language in SHELL_LANGUAGES else console_commands(example.text)
            result = self._run_shell(example, script)
        result.http_failures += [line for line in self._failures.read_text().splitlines() if line]
        return result

    def _run_shell(self, example: Example, script: str) -> BlockResult:
        # The block runs as written; only the saving of its exported environment is appended, and it
        # runs only when the block succeeded (bash -e stops at the first failing command).
        wrapped = f"{script}\nenv -0 > {shlex.quote(str(self._state))}\n"
        try:
            completed = subprocess.run(["bash", "--noprofile", "--norc", "-e", "-c", wrapped], cwd=self.checkout,
                                       env=self.environment, stdin=subprocess.DEVNULL, capture_output=True,
                                       text=True, timeout=BLOCK_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as error:
            output = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
            return BlockResult(example, -1, f"{output}\n(timed out after {BLOCK_TIMEOUT_SECONDS} s)")
        if completed.returncode == 0:
            saved = self._state.read_bytes().decode(errors="replace").split("\0")
            self.environment = dict(entry.split("=", 1) for entry in saved if "=" in entry)
        return BlockResult(example, completed.returncode, completed.stdout + completed.stderr)

    def _python_source(self, text: str) -> str:
        for placeholder, variable in PLACEHOLDERS.items():
            if variable in self.environment:
                text = text.replace(placeholder, self.environment[variable])
        return re.sub(rf"https?://(?:127\.0\.0\.1|localhost):{DOCUMENTED_PORT}", self.live_url, text)

    def _run_python(self, example: Example) -> BlockResult:
        if self._python is None:
            self._python = subprocess.Popen([self._python_executable, "-u", "-c", _PYTHON_DRIVER], cwd=self.checkout,
                                            env=self.environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
        self._python.stdin.write(json.dumps({"source": self._python_source(example.text),
                                             "name": str(example)}) + "\n")
        self._python.stdin.flush()
        # The answer is the driver's last line; a block's own threads may print before it.
        lines: list[str] = []
        answer: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: answer.put(_read_until_answer(self._python.stdout, lines)),
                                  daemon=True)
        reader.start()
        try:
            returncode = answer.get(timeout=BLOCK_TIMEOUT_SECONDS)
        except queue.Empty:
            self._python.kill()
            self._python = None
            return BlockResult(example, -1, "".join(lines) + f"\n(timed out after {BLOCK_TIMEOUT_SECONDS} s)")
        if returncode is None:  # the interpreter exited (the block called sys.exit or crashed it)
            self._python = None
            return BlockResult(example, -1, "".join(lines) + "\n(the Python interpreter exited)")
        return BlockResult(example, returncode, "".join(lines))

    def _run_http(self, example: Example) -> BlockResult:
        head, _, body = example.text.partition("\n\n")
        request_line, *header_lines = _expand(head, self.environment).splitlines()
        method, target, *_version = request_line.split()
        headers = dict(line.split(":", 1) for line in header_lines if line.strip())
        headers = {name.strip(): value.strip() for name, value in headers.items()}
        url = target if "://" in target else self.live_url + target
        url = re.sub(rf"^https?://(?:127\.0\.0\.1|localhost):{DOCUMENTED_PORT}", self.live_url, url)
        answer = requests.request(method, url, headers=headers, data=_expand(body, self.environment).encode() or None,
                                  timeout=60)
        failures = [f"{method} {target} answered {answer.status_code}"] if answer.status_code >= 400 else []
        return BlockResult(example, 0, f"{answer.status_code}\n{answer.text}", failures)


_ANSWER = "\x00doctest-python-block-done "

#: Runs each JSON line ``{"source", "name"}`` of stdin in one namespace; prints the block's output,
#: then ``_ANSWER`` and 0 or 1 on a line of its own.
_PYTHON_DRIVER = f"""
import json, sys, traceback
namespace = {{"__name__": "__main__"}}
for line in sys.stdin:
    block = json.loads(line)
    try:
        exec(compile(block["source"], block["name"], "exec"), namespace)
        status = 0
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    print({_ANSWER!r} + str(status), flush=True)
"""


def _read_until_answer(stream, lines: list[str]) -> int | None:
    for line in stream:
        if line.startswith(_ANSWER):
            return int(line[len(_ANSWER):])
        lines.append(line)
    return None


def _expand(text: str, environment: Mapping[str, str]) -> str:
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda match: environment.get(match[1] or match[2], match[0]), text)


def shutil_which(program: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"{program} is not installed; the doc tests run the documentation's {program} lines.")
    return found


