"""Every shell and HTTP example of README.md and docs/*.md runs, verbatim, against a live server.

An example that drifts from the code (a renamed command, a field the API now rejects, an example
body that is a 422) fails here. Blocks that cannot run here say why in a
``<!-- doctest: skip (reason) -->`` marker (see tests/docs/markdown_examples.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.conftest import REPOSITORY
from tests.docs.markdown_examples import (
    DocRunner, Example, MarkerError, documentation_files, extract_examples,
)

DOCUMENTS = [str(path.relative_to(REPOSITORY)) for path in documentation_files(REPOSITORY)]
BIN = Path(__import__("sys").executable).parent


def examples_of(relative_path: str) -> list[Example]:
    return extract_examples((REPOSITORY / relative_path).read_text(), relative_path)


def run_examples(examples: list[Example], server, tmp_path: Path) -> tuple[int, list[str]]:
    """Run the runnable ones in order (they share exported variables); returns (run, failure reports)."""
    runner = DocRunner(REPOSITORY, tmp_path / "run", server.environment, server.url, bin_dirs=[BIN])
    failures = []
    runnable = [example for example in examples if example.runnable]
    for example in runnable:
        result = runner.run(example)
        if not result.ok:
            failures.append(result.describe())
    return len(runnable), failures


def test_the_documentation_has_examples_and_every_marker_is_valid():
    examples = [example for document in DOCUMENTS for example in examples_of(document)]
    assert "README.md" in DOCUMENTS and "docs/api.md" in DOCUMENTS
    assert sum(example.runnable for example in examples) >= 10, "the harness found too few examples to run"
    for example in examples:
        assert example.runnable or example.skip_reason.strip(), example


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_example_runs(document, request, tmp_path):
    examples = examples_of(document)
    if not any(example.runnable for example in examples):
        pytest.skip(f"{document} has no runnable shell or HTTP example "
                    f"({len(examples)} marked skip)")
    doc_server = request.getfixturevalue("doc_server")  # a server only for a page with something to run
    _, failures = run_examples(examples, doc_server, tmp_path)
    assert not failures, "\n\n".join(failures)


# ------------------------------------------------------------------------------ the harness itself
BROKEN = '''# A page with one good example and drifted ones

```sh
curl -s $PASTO/api/v1/experiments -H "Authorization: Bearer $READ"
```

An observation for a round that has not started (what docs/api.md once showed):

```sh
curl -s -X POST $PASTO/api/v1/experiments/doc-harness/observations \\
  -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \\
  -d '{"observations": [{"id": "e1", "unit": "u1", "round": 7, "values": {"x": 1.0}}]}' | python3 -m json.tool
```

```console
$ pasto no-such-command
usage: ...
```

```http
POST /api/v1/experiments/doc-harness/assign HTTP/1.1
Authorization: Bearer $READ
Content-Type: application/json

{"unit": "user-1"}
```

<!-- doctest: skip (shows what a reader would type into a browser) -->
```sh
open http://127.0.0.1:8000/
```
'''


def test_a_drifted_example_fails_and_a_good_one_passes(doc_server, tmp_path):
    from pasto_client import Client

    with Client(doc_server.url, doc_server.environment["ADMIN"]) as client:
        client.create_experiment(name="doc-harness", arms=[{"name": "a"}, {"name": "b"}], metrics=["x"],
                                 objective={"primary": "x"}, round_seconds=3600)
    page = tmp_path / "broken.md"
    page.write_text(BROKEN)
    examples = extract_examples(page.read_text(), "broken.md")
    assert [(example.language, example.runnable) for example in examples] == [
        ("sh", True), ("sh", True), ("console", True), ("http", True), ("sh", False)]
    assert examples[-1].skip_reason == "shows what a reader would type into a browser"
    runner = DocRunner(REPOSITORY, tmp_path / "run", doc_server.environment, doc_server.url, bin_dirs=[BIN])
    good, drifted_curl, bad_command, forbidden_http = (runner.run(example) for example in examples[:4])
    assert good.ok, good.describe()
    assert not drifted_curl.ok and "status >= 400" in drifted_curl.describe()  # inside a pipeline, too
    assert not bad_command.ok and bad_command.returncode != 0
    assert not forbidden_http.ok and "answered 403" in forbidden_http.describe()
    _, failures = run_examples(examples, doc_server, tmp_path / "all")
    assert len(failures) == 3


def test_the_documented_port_goes_to_the_live_server(doc_server, tmp_path):
    example = Example("inline.md", 1, "sh", "curl -s http://127.0.0.1:8000/healthz\n")
    result = DocRunner(REPOSITORY, tmp_path, doc_server.environment, doc_server.url, bin_dirs=[BIN]).run(example)
    assert result.ok and '"status"' in result.output, result.describe()


@pytest.mark.parametrize("marker", ["<!-- doctest: skip -->", "<!-- doctest: skip () -->",
                                    "<!-- doctest: run-later (no such directive) -->"])
def test_a_marker_without_a_reason_or_unknown_is_an_error(marker):
    with pytest.raises(MarkerError):
        extract_examples(f"{marker}\n```sh\ntrue\n```\n", "page.md")


def test_fences_inside_lists_and_other_languages():
    markdown = ("- item\n\n  ```bash\n  echo one\n  ```\n\n```json\n{}\n```\n\n"
                "````sh\n```\nnot a fence end\n````\n")
    examples = extract_examples(markdown, "page.md")
    assert [(example.line, example.text) for example in examples] == [
        (3, "echo one\n"), (11, "```\nnot a fence end\n")]
