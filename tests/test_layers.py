"""Imports in src/ only go down: the allowed direction, written once (LAYERS).

Every ``import`` in src/ is read, those inside functions included: a layer (a folder of
src/, or a top-level module) may import its own modules and those of lower floors,
never a floor above or a neighbour on its own floor, so no two layers import each other.
No file of src/ and no function in it is longer than its limit (MAX_FILE_LINES,
MAX_FUNCTION_LINES).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest floor first. A floor may import any floor below it; the layers sharing a floor
# do not import each other.
LAYERS: list[set[str]] = [
    {"registry", "files", "text", "errors", "entry"},
    {"sharding"},
    {"models"},
    {"data", "observe"},
    {"checkpoint"},
    {"config"},
    {"build"},
    {"planner"},
    {"trainer"},
    {"runs"},
    {"harness"},
]
FLOOR = {layer: i for i, floor in enumerate(LAYERS) for layer in floor}

# The longest a .py file of src/ and a function in it (methods and nested functions
# included, decorators not) may be, in lines.
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _layer(module: str) -> str | None:
    """``src.data.corpus`` -> ``data``; ``src.config`` -> ``config``; else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "src" and len(parts) > 1 else None


def _module_of(path: Path, src: Path) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    here = _module_of(path, src)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from src import data`` imports the layer ``data``.
            if module == "src":
                found += [(node.lineno, f"src.{a.name}") for a in node.names]
    return found


def layer_violations(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        own = _layer(_module_of(path, src))
        if own is None:
            continue
        for line, module in _imports(path, src):
            other = _layer(module)
            if other is None or other == own:
                continue
            where = f"{path.relative_to(src.parent)}:{line} imports {module}"
            if own not in FLOOR or other not in FLOOR:
                bad.append(f"{where}: a layer missing from LAYERS")
            elif FLOOR[other] >= FLOOR[own]:
                rel = "a neighbour" if FLOOR[other] == FLOOR[own] else "a higher layer"
                bad.append(f"{where}: {rel} ({other} above or beside {own})")
    return bad


def test_every_layer_of_src_is_placed() -> None:
    on_disk = {p.stem for p in SRC.glob("*.py")} | {
        p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()
    }
    assert on_disk - {"__init__"} - set(FLOOR) == set(), "add the new layer to LAYERS"


def test_imports_only_go_down() -> None:
    assert layer_violations() == []


def test_the_check_sees_upward_and_sideways_imports(tmp_path) -> None:
    """The checker itself: an upward import inside a function and a sideways one."""
    fake = tmp_path / "src"
    (fake / "data").mkdir(parents=True)
    (fake / "sharding").mkdir()
    (fake / "data" / "__init__.py").write_text("")
    (fake / "data" / "x.py").write_text("from src.observe import logs\n")
    (fake / "sharding" / "y.py").write_text(
        "def f():\n    from ..trainer import loop\n"
    )
    found = layer_violations(fake)
    assert any(
        "src/data/x.py:1 imports src.observe" in b and "neighbour" in b for b in found
    )
    assert any(
        "src/sharding/y.py:2 imports src.trainer" in b and "higher" in b for b in found
    )


def test_no_layer_holds_more_than_a_third_of_src() -> None:
    lines = {p: len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    total = sum(lines.values())
    per_layer: dict[str, int] = {}
    for path, n in lines.items():
        layer = _layer(_module_of(path, SRC)) or "src"
        per_layer[layer] = per_layer.get(layer, 0) + n
    biggest = max(per_layer, key=per_layer.get)
    assert per_layer[biggest] <= total / 3, (biggest, per_layer[biggest], total)


def oversized(src: Path = SRC) -> list[str]:
    """Each file of src/ over MAX_FILE_LINES and each function over
    MAX_FUNCTION_LINES, as ``path:line ... (n lines)``."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(src.parent)
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            bad.append(f"{rel}: {lines} lines (over {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(
                        f"{rel}:{node.lineno} {node.name}: {n} lines "
                        f"(over {MAX_FUNCTION_LINES})"
                    )
    return bad


def test_no_file_or_function_in_src_is_too_long() -> None:
    found = oversized()
    assert found == [], "too long:\n" + "\n".join(found)


#: What a model's forward would call to read parallel state from outside its
#: arguments (context parallelism's and the pipeline's lookups): models are given
#: positions and the cp object as arguments and their stage at build.
PARALLEL_STATE_CALLS = {"active", "stage_role"}


def parallel_state_calls(models: Path = SRC / "models") -> list[str]:
    """Each call in ``models`` of a function named in :data:`PARALLEL_STATE_CALLS`
    (``active(...)``, ``context_parallel.active(...)``, ``stage_role(...)``)."""
    bad = []
    for path in sorted(models.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func
            name = name.id if isinstance(name, ast.Name) else name
            if name in PARALLEL_STATE_CALLS:
                bad.append(f"{path.relative_to(models.parents[1])}:{node.lineno}")
    return bad


def test_models_read_no_parallel_state(tmp_path) -> None:
    assert parallel_state_calls() == []
    # the checker itself sees both forms
    (tmp_path / "m.py").write_text(
        "def f(self):\n    cp = context_parallel.active()\n    s = stage_role(self)\n"
    )
    assert [b.split(":")[1] for b in parallel_state_calls(tmp_path)] == ["2", "3"]


#: The config's groups: ``cfg.<group>`` is a read of the raw config.
CONFIG_GROUPS = {"model", "sharding", "precision", "trainer", "data", "logger", "optim"}
CONFIG_GROUPS |= {"sweep", "hydra"}


def config_reads_in_planner(src: Path = SRC) -> list[str]:
    """The planner works on the run plan: each import of a ``*_KEY`` / ``*_KEYS``
    name and each ``cfg.<group>`` attribute read in src/planner/."""
    bad = []
    for path in sorted((src / "planner").rglob("*.py")):
        rel = path.relative_to(src.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.endswith(("_KEY", "_KEYS")):
                        bad.append(f"{rel}:{node.lineno} imports {alias.name}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "cfg"
                and node.attr in CONFIG_GROUPS
            ):
                bad.append(f"{rel}:{node.lineno} reads cfg.{node.attr}")
    return bad


def test_the_planner_reads_no_config_keys() -> None:
    found = config_reads_in_planner()
    assert found == [], "config keys in src/planner/:\n" + "\n".join(found)


#: The most functions in src/ that may take both the raw config and the run plan
#: (resolution's hand-over to the launcher and the ranks: prepare, launch, the
#: Trainer, the ranks of sample.py, eval.py and export.py, which ``on_ranks`` calls
#: with both).
MAX_CONFIG_AND_PLAN = 11


def config_and_plan(src: Path = SRC) -> list[str]:
    """Each function of src/ taking the raw config (a ``DictConfig`` parameter, or
    one named ``cfg``) and the run plan (a ``RunPlan`` parameter, or one named
    ``resolved``, ``plan`` or ``run_plan``)."""
    both = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
            anns = [ast.unparse(a.annotation) if a.annotation else "" for a in args]
            names = [a.arg for a in args]
            raw = any("DictConfig" in a for a in anns) or "cfg" in names
            plan = any("RunPlan" in a for a in anns) or bool(
                {"resolved", "plan", "run_plan"} & set(names)
            )
            if raw and plan:
                both.append(f"{path.relative_to(src.parent)}:{node.lineno} {node.name}")
    return both


def test_few_functions_take_both_the_config_and_the_run_plan() -> None:
    found = config_and_plan()
    assert len(found) <= MAX_CONFIG_AND_PLAN, "\n".join(found)
