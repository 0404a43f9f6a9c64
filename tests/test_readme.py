# SPDX-License-Identifier: Apache-2.0
"""The README opens with exactly two commands. Every block it holds runs in
tests/test_docs_examples.py, against a real server."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_exactly_two_commands():
    head = README.split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", head, flags=re.S)
    assert [b.split("#")[0].strip() for b in blocks] == ["make serve", "make test"]
    assert head.index("make serve") < head.index("epd-encoder is the")
