"""docs/scaling.md's DuckDB example runs and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def test_the_python_example_prints_its_comments():
    # The page's other Python block (the stream job's foreachBatch sketch) needs a stream: not run.
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
                if "fetch_round_statistics" in block]
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*?\)\s+#\s*(\S.*?)(?:\s{2,}\(.*)?$", block,
                                                          re.MULTILINE)]
    assert len(expected) == 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(DOC), "exec"), {"__name__": "scaling_doc_example"})
    assert out.getvalue().splitlines() == expected
