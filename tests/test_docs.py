"""The README and docs/ stay true to the repository: links resolve, the site builds with
MkDocs in strict mode, the tests the testing page names exist, and the quick-loop command
it gives is the tier pytest.ini defines."""

import ast
import glob
import os
import re

import pytest

from tests.harness import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    with open(page) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(full):
            broken.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{os.path.relpath(page, ROOT)}: {broken}"


def _listed_tests(page):
    with open(page) as f:
        return re.findall(r"`(tests/[\w/]+\.py)::(\w+)", f.read())


def test_the_slowest_tests_the_testing_page_lists_exist():
    listed = _listed_tests(os.path.join(ROOT, "docs", "testing.md"))
    assert len(listed) >= 25
    missing = []
    for path, name in listed:
        full = os.path.join(ROOT, path)
        names = set()
        if os.path.exists(full):
            with open(full) as f:
                names = {n.name for n in ast.parse(f.read()).body
                         if isinstance(n, ast.FunctionDef)}
        if name not in names:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_docs_give_the_tier_commands_pytest_ini_defines():
    with open(os.path.join(ROOT, "pytest.ini")) as f:
        ini = f.read()
    assert "--strict-markers" in ini and "slow:" in ini
    for page in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "testing.md")):
        with open(page) as f:
            text = f.read()
        assert 'python -m pytest -q -n 2 -m "not slow"' in text, page
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    command = re.search(r"^python -m pytest.*$", ci, re.M).group(0)
    assert command in readme, "CI runs the README's test command"


def test_the_configuration_reference_is_generated_from_the_schema():
    from tfllm.config.reference import reference
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        stored = f.read()
    assert stored == reference(), ("docs/configuration.md is stale: python -m "
                                   "tfllm.config.reference > docs/configuration.md")


def test_the_site_builds_in_strict_mode(tmp_path):
    # `mkdocs build --strict` in this process (about a second): any warning, such as a link
    # to a page, file or heading that does not exist, or a page that does not build, fails.
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
        from mkdocs.exceptions import Abort
    except ImportError:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
    import logging

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    warnings = Warnings()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(warnings)
    try:
        config = load_config(os.path.join(ROOT, "mkdocs.yml"), site_dir=str(tmp_path / "site"))
        assert config.strict, "mkdocs.yml sets strict: true"
        try:
            build(config)
        except Abort:
            pass  # the warnings say why
    finally:
        logger.removeHandler(warnings)
    assert warnings.lines == []
    assert (tmp_path / "site" / "index.html").exists()
    # The notebooks the pages link to are part of the site.
    assert (tmp_path / "site" / "repo" / "notebooks" / "01_quickstart.ipynb").exists()
