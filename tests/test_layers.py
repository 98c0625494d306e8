"""tfllm's packages are floors: each imports only the floors below it, so the import graph
between them has no cycle, and a new package or a new upward import is a deliberate
change of this table (docs/architecture.md)."""

import ast
import pathlib

import tfllm

ROOT = pathlib.Path(tfllm.__file__).parent

#: lowest first; a package may import the packages of lower floors only
FLOORS = (
    ("contracts", "internals", "quiet", "confined"),  # ground: contracts, private-API fence
    ("runpaths",),  # every path of a workdir, joined from the contracts' names
    ("files",),  # the one way to write and delete (with the ground floor's names)
    ("runtime",),  # the host and the processes: devices, GPU checks, env, peers
    ("parallel",),  # mesh, rules table, layouts, placement, the mesh context
    ("config", "compiler", "optim", "data"),  # schema; compiling; AdamW; corpora, tokenizers
    ("checkpoint", "precision"),  # workdir and checkpoints; dtype policies, FP8
    ("families",),  # per model family: HF/keras-hub names, config fields, LoRA names
    ("models",),
    ("footprint", "generate"),  # what a device holds and whether a step fits (no compile);
    # KV-cache decoding
    ("train",),
    ("pretrained", "plan", "launch", "evals"),  # import/export; deviceless plans; the
    # launcher; lm-eval benchmarks
    ("doctor",),  # `tfllm doctor`: the host's and the job's checks, a run's memory fit
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


def test_every_page_numbers_the_floors_as_this_table():
    """One numbering of the floors: the architecture page, the README's tour and each
    package's docstring say the floor FLOORS gives it."""
    import re
    repo = ROOT.parent
    said = []  # (where, package, floor it says)
    floor = None
    for line in (repo / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"floor (\d+)\s+tfllm/(\w+)", line)
        if m:
            floor = int(m.group(1))
        if floor is not None and line.startswith(("floor", "   ")):
            said += [("docs/architecture.md", name, floor)
                     for name in re.findall(r"tfllm/(\w+)", line) if name in FLOOR]
        if line.startswith("floor 13"):
            floor = None
    tour = (repo / "README.md").read_text().split("## A tour of the code", 1)[1]
    for line in tour.split("```")[1].splitlines():
        m = re.match(r"(\d+)\s+([\w, ]+?)\s{2,}", line)
        if m:
            said += [("README.md", name.strip(), int(m.group(1)))
                     for name in m.group(2).split(",")]
    for init in ROOT.glob("*/__init__.py"):
        m = re.search(r"\b[Ff]loor (\d+)", init.read_text().split('"""')[1])
        if m:
            said.append((str(init.relative_to(repo)), init.parent.name, int(m.group(1))))
    assert {name for where, name, _ in said if where == "README.md"} == set(FLOOR)
    assert {name for where, name, _ in said if where.startswith("docs")} == set(FLOOR)
    wrong = [f"{where}: {name} on floor {n}, FLOORS says {FLOOR[name]}"
             for where, name, n in said if FLOOR.get(name) != n]
    assert not wrong, "\n".join(wrong)


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


def _module_graph():
    """{module: the tfllm modules it imports} (`from pkg import mod` counts as the module)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(kept + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    if target in modules and target != name:
                        graph[name].add(target)
    return graph


def test_no_modules_import_each_other_in_a_circle():
    graph, state, circles = _module_graph(), {}, []

    def visit(module, path):  # depth-first; a module met again on the path closes a circle
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, circles


#: the one module that joins a workdir's paths (`tfllm.runpaths.RunPaths`), and the table
#: of the names it joins
PATH_OWNERS = ("runpaths.py", "contracts.py")
#: the start of a per-client name in a workdir (a log, heartbeat, XLA cache, trace, lock)
CLIENT_NAMES = ("client_", "heartbeat.")


def _path_names():
    """{name constant of tfllm.contracts: its value} for what a run keeps in its workdir."""
    from tfllm import contracts
    return {n: getattr(contracts, n) for n in dir(contracts)
            if n.endswith(("_DIR", "_FILE")) or n == "MARKER"}


def _joins_a_run_path(arg, names) -> bool:
    """Whether a call's argument is a workdir name: spelled ("logs"), a contracts
    constant (LOGS_DIR, contracts.LOGS_DIR), a per-client name (f"client_{n}") or a
    path made of them (f"{TOKENIZER_DIR}/{TOKENIZER_MODEL_FILE}")."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value in names.values() or arg.value.startswith(CLIENT_NAMES)
    if isinstance(arg, ast.Name):
        return arg.id in names
    if isinstance(arg, ast.Attribute):
        return arg.attr in names and isinstance(arg.value, ast.Name) \
            and arg.value.id == "contracts"
    if isinstance(arg, ast.JoinedStr):
        first = arg.values[0] if arg.values else None
        return (isinstance(first, ast.Constant) and str(first.value).startswith(CLIENT_NAMES)
                or any(isinstance(v, ast.FormattedValue) and _joins_a_run_path(v.value, names)
                       for v in arg.values))
    return False


def test_no_path_of_a_workdir_is_joined_outside_runpaths():
    """Every path of a run's workdir is joined by `tfllm.runpaths.RunPaths`, the per-client
    ones included: no other module passes a workdir name (spelled, a `tfllm.contracts`
    constant, or a per-client name) to `os.path.join` or to `tfllm.files`, which joins
    relative names to its root (the launcher, the watchdog, the tokenizer, the runtime
    environment, the CLI and `Workdir` once each joined their own)."""
    names = _path_names()
    joined = []
    for path in sorted(ROOT.rglob("*.py")):
        if str(path.relative_to(ROOT)) in PATH_OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            joins = node.func.attr == "join" or (isinstance(node.func.value, ast.Name)
                                                and node.func.value.id == "files")
            for arg in node.args if joins else ():
                if _joins_a_run_path(arg, names):
                    joined.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                                  f"{ast.unparse(arg)}")
    assert len(names) >= 10 and not joined, joined


def test_no_test_module_imports_another():
    # What tests share lives in helper modules (tests/harness.py, tests/<area>/<name>.py
    # not named test_*): importing a test module runs its module-level setup and couples
    # one file's tests to another's names.
    tests_root = ROOT.parent / "tests"
    found = []
    for path in sorted(tests_root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(tests_root.parent)}:{node.lineno} imports {n}"
                      for n in names if n.startswith("tests.")
                      and n.split(".")[-1].startswith("test_")]
    assert found == [], "\n".join(found)
