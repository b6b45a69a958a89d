"""The package's folders are its layers, and imports point one way: every module's imports (read with ast, the
ones inside functions included) form no cycle, and none points up the layers

    contract -> config (+ presets) -> layout -> planner -> data, loggers -> backends -> model -> parallel -> hf
    -> train -> export -> launch -> run -> views (live, cli, gallery, the package's face)

A layer is a folder (two top-level files belong to the views: the package's face and `python -m moelab`). A module
may import its own layer and any layer below it. A package face (an __init__.py that lower layers pass through when
they import one of its modules) imports nothing at module level from a layer above its lowest member, and no package
face takes part in an import cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moelab"
# (layer name, folders (or the views' few top-level files) relative to moelab/), lowest first
LAYERS = [
    ("contract", ["contract/"]),
    ("config", ["config/", "presets/"]),
    ("layout", ["layout/"]),
    ("planner", ["planner/"]),
    ("data", ["data/", "loggers/"]),
    ("backends", ["backends/"]),
    ("model", ["model/"]),
    ("parallel", ["parallel/"]),
    ("hf", ["hf/"]),
    ("train", ["train/"]),
    ("export", ["export/"]),
    ("launch", ["launch/"]),
    ("run", ["run/"]),
    ("views", ["live/", "cli/", "gallery/", "__init__.py", "__main__.py"]),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# A public noun's view methods open their view when called (run.dashboard(), run.plot_memory(),
# sweep.compare()): the views read runs, and a Run offers them. These imports, and only these, point up.
VIEW_HOOKS = {("moelab.run.run", "moelab.live"), ("moelab.run.run", "moelab.live.plots"),
              ("moelab.run.run", "moelab.live.expert_tokens"),
              ("moelab.run.sweep", "moelab.live"), ("moelab.run.sweep", "moelab.live.compare")}
# (the views import Run, never the other way round at module level; a hook is no cycle of module-level imports)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).as_posix()
    best = max(((len(prefix), name) for name, prefixes in LAYERS for prefix in prefixes
                if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix))), default=None)
    assert best is not None, f"moelab/{rel} is on no layer: add it to LAYERS"
    return best[1]


def imports(path: Path, known: dict[str, Path], module_level_only: bool = False) -> set[str]:
    """The moelab modules `path` imports (an imported name that is a module counts as that module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("moelab") and name != me:
                found.add(name)
    return found


def loops(g: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first walk of the import graph `g` closes (each as its modules, first repeated)."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def test_every_module_is_on_a_layer_and_no_import_points_up():
    known = modules()
    upward = []
    for name, targets in graph().items():
        for target in targets:
            if (name, target) in VIEW_HOOKS:
                continue
            if RANK[layer_of(known[target])] > RANK[layer_of(known[name])]:
                upward.append(f"{name} ({layer_of(known[name])}) -> {target} ({layer_of(known[target])})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_the_view_hooks_are_still_needed():
    g = graph()
    stale = [hook for hook in VIEW_HOOKS if hook[1] not in g.get(hook[0], set())]
    assert not stale, f"allowed upward imports that no longer exist (remove them from VIEW_HOOKS): {stale}"


def test_no_import_cycle():
    """A view hook is the one import that points back (the view imports the noun); every other loop fails."""
    g = {name: {t for t in targets if (name, t) not in VIEW_HOOKS} for name, targets in graph().items()}
    cycles = [" -> ".join(loop) for loop in loops(g)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_package_faces_that_lower_layers_pass_through_load_nothing():
    """Importing moelab.contract.folder runs moelab/run/__init__.py first: it must not load Run (a higher layer)."""
    known = modules()
    for name, path in known.items():
        if path.name != "__init__.py" or name == "moelab":
            continue
        members = [p for n, p in known.items() if n.startswith(name + ".")]
        lowest = min(RANK[layer_of(p)] for p in members) if members else RANK[layer_of(path)]
        loaded = [t for t in imports(path, known, module_level_only=True)
                  if RANK[layer_of(known[t])] > lowest]
        assert not loaded, f"{name}/__init__.py loads {loaded} at import, above its lowest member's layer"


def test_the_checker_sees_imports_that_point_up(tmp_path):
    """The checker itself: a lazy import inside a function is read, and an upward one is found."""
    src = tmp_path / "moelab" / "config.py"
    src.parent.mkdir()
    src.write_text("def f():\n    from moelab.cli import main\n")
    (tmp_path / "moelab" / "cli.py").write_text("")
    known = {"moelab.config": src, "moelab.cli": tmp_path / "moelab" / "cli.py"}
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert imports(src, known) == {"moelab.cli"}
    finally:
        ROOT = old


def face_cycles(known: dict[str, Path], module_level_only: bool = False) -> list[str]:
    """Loops that pass through a package face (tests below): by default an import inside a function counts, as it
    runs the faces above its module when it is called (a view hook, the one declared upward import, does not)."""
    faces = {name for name, path in known.items() if path.name == "__init__.py" and name != "moelab"}
    g: dict[str, set[str]] = {}
    for name, path in known.items():
        mine = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)} | (
            {name} if path.name == "__init__.py" else set())
        out = set()
        for target in imports(path, known, module_level_only=module_level_only) - {
                t for (n, t) in VIEW_HOOKS if n == name}:
            out.add(target)
            parts = target.split(".")
            out |= {p for p in (".".join(parts[:k]) for k in range(2, len(parts))) if p in faces and p not in mine}
        g[name] = out - {name}
    return [" -> ".join(loop) for loop in loops(g) if any(m in faces for m in loop)]


def test_no_cycle_through_package_faces_at_import_time():
    """What runs when a module is imported: its module-level imports, and for each, the __init__.py of every package
    above the imported module that the importer is not already inside (Python runs a package's face before any
    module in it). No loop may pass through a face."""
    cycles = face_cycles(modules(), module_level_only=True)
    assert not cycles, "import-time cycles through package faces:\n" + "\n".join(cycles)


def test_no_cycle_through_package_faces_with_imports_inside_functions():
    """The same, where an import inside a function counts (a lazy import runs the faces above its module when the
    function is first called): model/experts.py -> backends -> te -> model was such a loop."""
    cycles = face_cycles(modules())
    assert not cycles, "cycles through package faces (imports inside functions included):\n" + "\n".join(cycles)


def test_the_face_checker_sees_a_loop_through_a_face(tmp_path):
    """A face that loads a module which imports another package's member whose face loads the first: a loop."""
    pkg = tmp_path / "moelab"
    for rel, text in {"__init__.py": "", "a/__init__.py": "from moelab.a.x import X\n",
                      "a/x.py": "from moelab.b.y import Y\nX = 1\n", "b/__init__.py": "",
                      "b/y.py": "from moelab.a.z import Z\nY = 1\n", "a/z.py": "Z = 1\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        known = {module_name(p): p for p in sorted(pkg.rglob("*.py"))}
        assert any("moelab.a" in c.split(" -> ") for c in face_cycles(known, True)), face_cycles(known, True)
        (pkg / "b/y.py").write_text("def f():\n    from moelab.a.z import Z\nY = 1\n")  # the same loop, lazily
        assert not face_cycles(known, module_level_only=True)
        assert any("moelab.a" in c.split(" -> ") for c in face_cycles(known)), face_cycles(known)
    finally:
        ROOT = old


# ---------------------------------------------------------------------- train/ is entered in one place
# Nothing outside train/ imports it but the rank entry point (and the warm server that preloads the entry's
# modules) and the benchmark callers; readers (cli, export, launch, run, live) read a run's files through
# contract/. Imports inside functions count, and so does a module named by its full dotted name in a string
# (importlib.import_module, a preload list).
# (importer, or a package of importers; the train module it may import): why
ALLOWED = {
    ("moelab.launch.entry", "moelab.train.trainer"): "the rank entry point trains",
    ("moelab.launch.entry", "moelab.train.bench"): "the rank entry point's bench mode times the steps",
    ("moelab.launch.warm", "moelab.train.trainer"): "the warm server preloads what the rank entry imports",
    ("moelab.launch.submit", "moelab.train.preflight"): "the one preflight: a rank's own checks, before submit",
    ("moelab.cli.tools", "moelab.train.bench"): "benchmark caller: `moelab bench`",
    ("moelab.gallery", "moelab.train.bench"): "benchmark caller: the gallery's measured entries",
}


def named_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The moelab modules a file names by their full dotted name in a string constant."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known}


def entries_into_train(known: dict[str, Path]) -> set[tuple[str, str]]:
    """Every (module outside train/, train module it imports or names)."""
    found = set()
    for name, path in known.items():
        if name.startswith("moelab.train"):
            continue
        for target in imports(path, known) | named_modules(path, known):
            if target == "moelab.train" or target.startswith("moelab.train."):
                found.add((name, target))
    return found


def allowed(importer: str, target: str) -> bool:
    return any(target == t and (importer == i or importer.startswith(i + ".")) for i, t in ALLOWED)


def test_nothing_outside_train_imports_train_but_the_rank_entry_and_the_benchmark_callers():
    bad = sorted(f"{a} -> {b}" for a, b in entries_into_train(modules()) if not allowed(a, b))
    assert not bad, ("imports of train/ from outside it (read the run's files through moelab.contract; only the "
                     "rank entry point and the benchmark callers enter train/):\n" + "\n".join(bad))


def test_every_allowed_entry_is_still_used():
    used = entries_into_train(modules())
    stale = [(i, t) for i, t in ALLOWED if not any(b == t and (a == i or a.startswith(i + ".")) for a, b in used)]
    assert not stale, f"allowed entries into train/ that no longer exist (remove them from ALLOWED): {stale}"


def test_the_checker_sees_a_lazy_import_and_a_module_named_in_a_string(tmp_path):
    """A function-level import and a dotted name passed to importlib are both entries into train/."""
    pkg = tmp_path / "moelab"
    files = {"__init__.py": "", "train/__init__.py": "", "train/trainer.py": "", "run/__init__.py": "",
             "run/lazy.py": "def f():\n    from moelab.train.trainer import Trainer\n",
             "run/named.py": "import importlib\nM = importlib.import_module('moelab.train.trainer')\n"}
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        known = {module_name(p): p for p in sorted(pkg.rglob("*.py"))}
        assert entries_into_train(known) == {("moelab.run.lazy", "moelab.train.trainer"),
                                             ("moelab.run.named", "moelab.train.trainer")}
    finally:
        ROOT = old
