"""Every shell, Python and HTTP example of README.md and docs/*.md runs, verbatim, against a live server.

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
    failures = []
    runnable = [example for example in examples if example.runnable]
    with DocRunner(REPOSITORY, tmp_path / "run", server.environment, server.url, bin_dirs=[BIN]) as runner:
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


#: Pages whose examples run against the live demo's experiment (``pasto demo``'s ``demo-ranking``,
#: created on the doc server as the demo creates it, as a reader beside ``make run`` has it) and the
#: reader's own ``feed-ranking`` of the same arms and metrics.
ON_THE_DEMO = {"docs/client.md"}


def create_the_demo_experiment(server) -> None:
    from pasto_client import Client
    from service.demo import ensure_experiment, load_demo_scenario

    with Client(server.url, server.environment["ADMIN"]) as client:
        assert ensure_experiment(client, load_demo_scenario(), round_seconds=3600) == "demo-ranking"
        demo = client.get_experiment("demo-ranking")
        client.create_experiment(name="feed-ranking", arms=demo["arms"], metrics=demo["metrics"],
                                 objective=demo["objective"], round_seconds=3600)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_example_runs(document, request, tmp_path):
    examples = examples_of(document)
    # A page without a runnable block passes only when each of its blocks says why it cannot run
    # (test_the_documentation_has_examples_and_every_marker_is_valid); it is not skipped.
    assert all(example.runnable or example.skip_reason for example in examples)
    if not any(example.runnable for example in examples):
        return
    doc_server = request.getfixturevalue("doc_server")  # a server only for a page with something to run
    if document in ON_THE_DEMO:
        create_the_demo_experiment(doc_server)
    ran, failures = run_examples(examples, doc_server, tmp_path)
    assert ran == sum(example.runnable for example in examples)
    assert not failures, "\n\n".join(failures)


def test_a_planted_error_in_the_client_page_fails(harness_server, tmp_path):
    """docs/client.md's recommender example with the experiment's name misspelt: the run reports it."""
    text = (REPOSITORY / "docs/client.md").read_text()
    planted = text.replace('LocalAssigner(client, "demo-ranking")', 'LocalAssigner(client, "demo-rankin")', 1)
    assert planted != text
    create_the_demo_experiment(harness_server)
    examples = extract_examples(planted, "docs/client.md")
    assert any(example.language == "python" and example.runnable for example in examples)
    _, failures = run_examples(examples, harness_server, tmp_path)
    assert failures and "demo-rankin" in failures[0] and "PastoAPIError" in failures[0], failures


def test_a_python_block_shares_names_with_the_next_and_reports_its_exception(harness_server, tmp_path):
    page = ("```python\nfrom pasto_client import Client\nclient = Client('http://127.0.0.1:8000', token='<read token>')\n```\n\n"
            "```python\nprint(client.health()['status'])\n```\n\n```python\nundefined_name\n```\n")
    examples = extract_examples(page, "page.md")
    with DocRunner(REPOSITORY, tmp_path / "run", harness_server.environment, harness_server.url,
                   bin_dirs=[BIN]) as runner:
        first, second, third = (runner.run(example) for example in examples)
    assert first.ok and second.ok and "ok" in second.output, second.describe()
    assert not third.ok and "NameError" in third.output


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


def test_a_drifted_example_fails_and_a_good_one_passes(harness_server, tmp_path):
    from pasto_client import Client

    with Client(harness_server.url, harness_server.environment["ADMIN"]) as client:
        client.create_experiment(name="doc-harness", arms=[{"name": "a"}, {"name": "b"}], metrics=["x"],
                                 objective={"primary": "x"}, round_seconds=3600)
    page = tmp_path / "broken.md"
    page.write_text(BROKEN)
    examples = extract_examples(page.read_text(), "broken.md")
    assert [(example.language, example.runnable) for example in examples] == [
        ("sh", True), ("sh", True), ("console", True), ("http", True), ("sh", False)]
    assert examples[-1].skip_reason == "shows what a reader would type into a browser"
    runner = DocRunner(REPOSITORY, tmp_path / "run", harness_server.environment, harness_server.url,
                       bin_dirs=[BIN])
    good, drifted_curl, bad_command, forbidden_http = (runner.run(example) for example in examples[:4])
    assert good.ok, good.describe()
    assert not drifted_curl.ok and "status >= 400" in drifted_curl.describe()  # inside a pipeline, too
    assert not bad_command.ok and bad_command.returncode != 0
    assert not forbidden_http.ok and "answered 403" in forbidden_http.describe()
    _, failures = run_examples(examples, harness_server, tmp_path / "all")
    assert len(failures) == 3


def test_the_documented_port_goes_to_the_live_server(harness_server, tmp_path):
    example = Example("inline.md", 1, "sh", "curl -s http://127.0.0.1:8000/healthz\n")
    runner = DocRunner(REPOSITORY, tmp_path, harness_server.environment, harness_server.url, bin_dirs=[BIN])
    result = runner.run(example)
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
