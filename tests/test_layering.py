"""The house's layering, held against the code's imports (docs/architecture.md,
"Layers"): each part of hpctrain imports only parts below it or beside it,
no modules import each other in a circle, at any level, and no parts
either: of two parts of one level, one imports the other, never both ways
(run/ -> pipeline/ -> checkpoints/, not back), so each level has an order of
its own too.

    .venv/bin/python -m pytest -q tests/test_layering.py
"""
import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "hpctrain")

# Top to bottom. A part may import its own level and below; a command
# (COMMANDS) anything.
LEVELS = [
    {"loops"},
    {"run", "interop", "checkpoints", "state", "report", "pipeline", "dist"},
    {"comm", "optim"},
    {"nn", "data"},
    {"base", "flags", "__init__"},
]
# What users run: they sit on top of everything.
COMMANDS = {"train", "mnist", "checkpoint", "plot", "bench", "predict", "evaluate", "generate", "command", "__main__"}
MAINS = "__main__"   # python -m hpctrain.<package>: a package's own command


def modules():
    """{module name: path} of every module of the package."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[rel[:-9] if rel.endswith(".__init__") else rel] = path
    return found


def import_targets(module, path):
    """(node, names) for every import of hpctrain in the file, at any depth:
    `import hpctrain.X` gives its names, `from T import ...` (relative ones
    resolved) gives [T]."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hpctrain"):
                yield node, [target]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("hpctrain")]
            if names:
                yield node, names


def imports(module, path, known):
    """The hpctrain modules `module` imports (relative ones resolved), at any depth in the file."""
    out = set()
    for node, names in import_targets(module, path):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                sub = f"{names[0]}.{alias.name}"
                out.add(sub if sub in known else names[0])
        else:
            out |= set(names)
    return {m for m in out if m in known and m != module}


def part(module):
    """hpctrain.comm.ps.server -> comm; hpctrain.train -> train."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def level(name):
    for i, names in enumerate(LEVELS):
        if name in names:
            return i
    raise AssertionError(f"hpctrain.{name} has no place in LEVELS (tests/test_layering.py): give it one")


def test_every_part_imports_only_its_level_and_below():
    known = modules()
    wrong = []
    for module, path in sorted(known.items()):
        here = part(module)
        if here in COMMANDS or module.endswith(MAINS):
            continue
        for target in imports(module, path, known):
            there = part(target)
            if there in COMMANDS:
                wrong.append(f"{module} imports the command {target}")
            elif level(there) < level(here):
                wrong.append(f"{module} ({here}) imports {target} ({there}), a part above it")
    assert not wrong, "\n".join(wrong)


def test_no_modules_import_each_other_in_a_circle():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    # Tarjan's strongly connected components
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    # a package's __init__ that hands on its modules' names is no circle of
    # code: leave out the edges from a package to its own modules
    real = []
    for group in circles:
        inner = {m: {t for t in graph[m] & set(group) if not t.startswith(m + ".")} for m in group}
        if any(inner.values()):
            real.append(group)
    assert not real, real


def part_imports(known):
    """{part: the other parts it imports} (commands and packages' own
    commands left out: they sit on top and import anything)."""
    graph = {}
    for module, path in known.items():
        here = part(module)
        if here in COMMANDS or module.endswith(MAINS):
            continue
        there = {part(t) for t in imports(module, path, known)} - COMMANDS - {here}
        graph.setdefault(here, set()).update(there)
    return graph


def test_no_parts_import_each_other_in_a_circle():
    """Package level: a circle of parts (checkpoints/ importing run/ for a
    temporary file while run/ imports pipeline/, which imports checkpoints/)
    is named with the imports that make each of its steps."""
    known = modules()
    graph = part_imports(known)

    def reaches(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if a in reaches(b):
                which = sorted(f"{m} -> {t}" for m, p in known.items() if part(m) == a and not m.endswith(MAINS)
                               for t in imports(m, p, known) if part(t) == b)
                circles.append(f"{a} imports {b}, which leads back to {a}: " + ", ".join(which))
    assert not circles, "parts that import each other in a circle:\n" + "\n".join(circles)


def test_the_layering_names_every_part():
    for module in modules():
        here = part(module)
        if here not in COMMANDS and not module.endswith(MAINS):
            level(here)


def test_every_import_of_hpctrain_names_a_module_that_exists():
    """An import of a module that was renamed or removed fails only when its
    line runs; imports inside functions (the optional ones: torch's models,
    numba, the GPU's) may not run in any test here. So every `from
    hpctrain.X import ...` and `import hpctrain.X`, at any depth, must name
    a module or package of the package."""
    known = modules()
    missing = []
    for module, path in sorted(known.items()):
        for node, names in import_targets(module, path):
            missing += [f"{path}:{node.lineno}: {name}" for name in names if name not in known]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
