"""The package's layers point one way: cli -> demo -> launch -> doctor -> train -> model / data / checkpoint -> plan
-> mesh / shared_link -> config / distributed / hardware / crossing -> errors. Every import counts, also one inside
a function (where a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "meshtune"

LAYERS = [  # lowest first; a module imports from its own layer's package or from lower layers only
    ["meshtune", "meshtune.errors", "meshtune.worker_env", "meshtune.faults", "meshtune.checksums",
     "meshtune.mailbox", "meshtune.units", "meshtune.package_clash"],
    ["meshtune.config", "meshtune.distributed", "meshtune.hardware", "meshtune.logs", "meshtune.crossing"],
    ["meshtune.mesh", "meshtune.shared_link"],  # the run's mesh (read by the plan, built over the process group); a
    # node's pipelines on its link (read by the plan and the projections)
    ["meshtune.plan", "meshtune.compat"],
    ["meshtune.data", "meshtune.model", "meshtune.checkpoint"],
    ["meshtune.train", "meshtune.export"],
    ["meshtune.doctor"],  # the launcher's preflight runs the doctor's checks: the doctor never imports the launcher
    ["meshtune.launch"],
    ["meshtune.demo"],
    ["meshtune.cli"],
    ["meshtune.__main__"],
]


def module_name(path: Path) -> str:
    parts = ["meshtune", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The layer entry a module belongs to: its package (meshtune.model.lora -> meshtune.model) or itself."""
    entries = [entry for layer in LAYERS for entry in layer]
    return max((e for e in entries if module == e or module.startswith(e + ".")), key=len)


def layer_of(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit(module) in layer)


def imports(path: Path) -> set[str]:
    """meshtune modules `path` imports anywhere in its body (a `from meshtune.x import y` names module x.y where
    that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "meshtune"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "meshtune":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).is_file()
                found.add(candidate if is_module else node.module)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)  # raises StopIteration / ValueError for a module no layer names


def test_no_import_points_up_or_sideways():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            mine, theirs = layer_of(module), layer_of(target)
            if theirs > mine or (theirs == mine and unit(target) != unit(module)):
                wrong.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    edges = graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_the_checks_see_a_function_level_import(tmp_path):
    """The graph reads imports inside functions too (the kind that hid a cycle launch -> model -> launch)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from meshtune.launch.nodes import describe\n    import meshtune.model.lora\n")
    assert imports(source) == {"meshtune.launch.nodes", "meshtune.model.lora"}
