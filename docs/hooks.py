"""MkDocs hook: repository files the pages link to become part of the site.

The pages link to files outside `docs/` as the repository page shows them
(`../notebooks/01_quickstart.ipynb`, `../launch/README.md`, `../benchmarks/results/...`),
so the same link works on the repository page, in an editor and on the site. MkDocs knows
only the files under `docs/`, and `mkdocs build --strict` would refuse such a link as "not
found". This hook adds every repository file that a page (or a Markdown file so added)
links to, under `repo/` in the site: Markdown files are rendered as pages (their own links
and anchors are then checked too), anything else is copied. A link to a file that does not
exist is left alone, so strict mode still fails on it. A page so added that links back
into `docs/` (the README links to every page) gets that link as an absolute one, which
MkDocs resolves from `docs/` (`validation.absolute_links: relative_to_docs`).
"""

import os
import posixpath
import re

from mkdocs.structure.files import File, InclusionLevel

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _outside_links(path, src_uri):
    """The docs-relative URIs (starting `../`) of the links of one Markdown file."""
    with open(path, encoding="utf-8") as f:
        text = _FENCE.sub("", f.read())
    for target, _ in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:: not files
            continue
        uri = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target))
        if uri.startswith("../"):
            yield uri


def on_files(files, config):
    docs = os.path.abspath(config.docs_dir)
    root = os.path.dirname(docs)
    todo = [f for f in files if f.is_documentation_page()]
    while todo:
        page = todo.pop()
        for uri in _outside_links(page.abs_src_path, page.src_uri):
            path = os.path.normpath(os.path.join(docs, uri))
            if (uri in files or not os.path.isfile(path)
                    or not path.startswith(root + os.sep) or path.startswith(docs + os.sep)):
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            # Where MkDocs would put the file if it were under docs/, moved under repo/.
            dest = File(rel, root, config.site_dir, config.use_directory_urls).dest_uri
            added = File(uri, docs, config.site_dir, config.use_directory_urls,
                         dest_uri="repo/" + dest, inclusion=InclusionLevel.NOT_IN_NAV)
            files.append(added)
            if added.is_documentation_page():
                todo.append(added)
    return files


def on_page_markdown(markdown, page, config, files):
    if not page.file.src_uri.startswith("../"):
        return markdown
    docs = os.path.abspath(config.docs_dir)

    def into_docs(match):
        uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri),
                                                match.group(1)))
        path = os.path.normpath(os.path.join(docs, uri))
        if not path.startswith(docs + os.sep):
            return match.group(0)
        return "](/" + os.path.relpath(path, docs).replace(os.sep, "/") + (match.group(2) or "") + ")"

    # Links only, not text inside code blocks (odd pieces of the split are the blocks).
    pieces = re.split(r"(^```.*?^```)", markdown, flags=re.S | re.M)
    return "".join(p if i % 2 else _LINK.sub(into_docs, p) for i, p in enumerate(pieces))
