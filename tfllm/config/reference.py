"""The configuration reference, generated from the schema: `python -m tfllm.config.reference`
prints docs/configuration.md (every key, its default, its allowed values and its help), so
the page cannot drift from `tfllm/config/schema.py` (tests/test_docs.py compares them)."""

from __future__ import annotations

import dataclasses
import json
import sys

from tfllm.config import schema

HEADER = """# Configuration reference

Generated from `tfllm/config/schema.py` by `python -m tfllm.config.reference >
docs/configuration.md`; do not edit by hand. A YAML file (`--config`) sets any of these
by section, `--set section.key=value` (repeatable) after it; unknown keys, wrong types
and out-of-range values are one-line errors naming the key.
"""


def _value(value) -> str:
    return "`" + json.dumps(value) + "`"  # as YAML reads it (null, true, "text", [])


def _allowed(meta: dict) -> str:
    if "choices" in meta:
        return ", ".join(f"`{c}`" for c in meta["choices"])
    low, high = meta.get("min"), meta.get("max")
    if low is not None and high is not None:
        return f"{low} to {high}"
    if low is not None:
        return f"at least {low}"
    if high is not None:
        return f"at most {high}"
    return ""


def reference() -> str:
    """docs/configuration.md's text."""
    config = schema.Config()
    out = [HEADER]
    for section in schema.SECTIONS:
        part = getattr(config, section)
        doc = (type(part).__doc__ or "").strip().splitlines()[0]
        out.append(f"\n## `{section}`\n\n{doc}\n")
        out.append("| key | default | allowed | meaning |\n|---|---|---|---|")
        for f in dataclasses.fields(part):
            meaning = " ".join(f.metadata.get("help", "").split()).replace("|", "\\|")
            out.append(f"| `{section}.{f.name}` | {_value(getattr(part, f.name))} | "
                       f"{_allowed(f.metadata)} | {meaning} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
