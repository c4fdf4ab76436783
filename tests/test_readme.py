"""The README's Python snippets run as pasted (extracted from the README itself)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, default_gguf, capsys):
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
    assert capsys.readouterr().out  # each snippet prints what it shows
