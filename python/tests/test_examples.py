"""The README's Python example, run as written, and the host-memory NumPy example."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, assert_all_ok, run_ranks

README = REPO / "README.md"
EXAMPLES = REPO / "python" / "examples"


def readme_example() -> str:
    """The ```python block of README.md's section "From Python"."""
    text = README.read_text()
    section = text.split("\n## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "README's From Python section has one python block"
    return blocks[0]


@pytest.mark.skipif(not README.exists(), reason="not run from a clone of the repository")
def test_readme_example_runs_as_written(tmp_path) -> None:
    script = tmp_path / "allgather.py"
    script.write_text(readme_example())
    results = run_ranks(2, script=script)
    assert_all_ok(results)
    for r in results:
        assert "all-gather of" in r.out and "ok" in r.out, r.out


@pytest.mark.parametrize("transport", ["ib", "shm"])
def test_numpy_example(transport: str) -> None:
    results = run_ranks(3, "--transport", transport, "--bytes", "65537", script=EXAMPLES / "allgather_numpy.py")
    assert_all_ok(results)
