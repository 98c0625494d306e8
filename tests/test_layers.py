"""tfllm's packages are floors: each imports only the floors below it, so the import graph
between them has no cycle, and a new package or a new upward import is a deliberate
change of this table (README, "Layout")."""

import ast
import pathlib

import tfllm

ROOT = pathlib.Path(tfllm.__file__).parent

#: lowest first; a package may import the packages of lower floors only
FLOORS = (
    ("contracts", "internals", "quiet", "confined"),  # ground: contracts, private-API fence
    ("parallel",),  # mesh, rules table, layouts, placement, the mesh context
    ("config", "compiler", "optim", "data"),  # schema; compiling; AdamW; corpora, tokenizers
    ("checkpoint", "precision"),  # workdir and checkpoints; dtype policies, FP8
    ("models",),
    ("generate",),
    ("train",),
    ("pretrained", "plan", "launch"),  # import/export; deviceless plans; the launcher
    ("cli", "notebook"),  # entry points
)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def _package_of(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    """(line, imported top-level tfllm package) of every import in the file, lazy ones
    inside functions included."""
    module = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module[:-1]
    if path.name == "__init__.py":
        package = module[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module]
            names += [f"{names[0]}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tfllm" and len(parts) > 1 and parts[1] in FLOOR:
                yield node.lineno, parts[1]


def test_every_package_has_a_floor():
    packages = {_package_of(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert packages - set(FLOOR) == set(), "add the new package to FLOORS"
    assert set(FLOOR) - packages == set(), "remove the deleted package from FLOORS"


def test_imports_only_look_down():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and path.name == "__init__.py":
            continue
        here = _package_of(path)
        for line, target in _imports(path):
            if target != here and FLOOR[target] >= FLOOR[here]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {here} "
                              f"(floor {FLOOR[here]}) imports {target} (floor {FLOOR[target]})")
    assert not upward, "\n".join(upward)


def test_tests_import_no_private_names():
    """Tests use tfllm (and each other) through public names only: `tests/harness.py`
    holds what they share."""
    private = []
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] in ("tfllm", "tests")):
                private += [f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not private, private
