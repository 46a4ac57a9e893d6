"""The README holds to its limits: at most 600 lines (what grows gets a short section there
and its full page under docs/), and every link in it reaches a file and a heading."""

import os
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit  # no subprocess, no multi-device training

LIMIT = 600


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    with open(path) as f:
        headings = [line.lstrip("#").strip() for line in f if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_readme_is_at_most_600_lines():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= LIMIT, (f"README.md has {len(lines)} lines, over its limit of {LIMIT}: give what grew a "
                                 f"short section there and move its details to a page under docs/")


def test_readme_links_reach_their_files_and_headings():
    readme = os.path.join(ROOT, "README.md")
    text = open(readme).read()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"\w+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(ROOT, target)) if target else readme
        assert os.path.exists(path), f"README.md links to {link}, which does not exist"
        if anchor and path.endswith(".md"):
            assert anchor in _anchors(path), f"README.md links to {link}: no such heading in {target or 'README.md'}"
