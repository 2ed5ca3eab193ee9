"""`auto` is read in two places only: the config package (what `auto` means where it is no run decision: a file's
format, the chat template, CPU pinning, and the `auto` of foreign files) and the plan package (the run plan's
choices). Every
other module receives the choice made, so no comparison with the string "auto" may appear anywhere else."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "meshtune"
READERS = ("config/", "plan/")  # a folder stands for every module in it


def reads_auto(relative: str) -> bool:
    """Whether a module (its path under src/meshtune) is one of the readers."""
    return any(relative == name or (name.endswith("/") and relative.startswith(name)) for name in READERS)


def reader_sources(name: str) -> list[str]:
    path = PACKAGE / name
    return [file.read_text() for file in sorted(path.rglob("*.py"))] if name.endswith("/") else [path.read_text()]


def is_auto(value: object) -> bool:
    """The string auto, or a collection holding it."""
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(is_auto(item) for item in value)
    return value == "auto"


def auto_names(tree: ast.Module) -> set[str]:
    """Names that stand for auto in a module: its constants bound to it (`MODE = "auto"`, `MODES = ("auto", ...)`),
    or imported from the config package or the plan package whose value it is. A comparison with one of them
    compares with auto."""
    names = set()
    for node in [*tree.body, *(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))]:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if is_auto(value):
                names |= {target.id for target in targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[:2] in (["meshtune", "config"],
                                                                                         ["meshtune", "plan"]):
            module = importlib.import_module(node.module)
            names |= {alias.asname or alias.name for alias in node.names
                      if is_auto(getattr(module, alias.name, None))}
    return names


def holds_auto(node: ast.expr, names: set[str]) -> bool:
    """An operand that is auto: the constant, a tuple, list or set holding it (also inside frozenset(...)), or a name
    standing for it."""
    if isinstance(node, ast.Constant):
        return is_auto(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(holds_auto(element, names) for element in node.elts)
    if isinstance(node, ast.Call):
        return any(holds_auto(argument, names) for argument in node.args)
    return isinstance(node, ast.Name) and node.id in names


def auto_comparisons(source: str) -> list[tuple[int, str]]:
    """Each comparison with auto in `source`, by line: `==`, `!=`, `is`, `in`, `not in` on either side, and a
    `case "auto":` of a match statement."""
    tree = ast.parse(source)
    names = auto_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(holds_auto(o, names) for o in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and holds_auto(node.value, names):
            found.append((node.lineno, f"case {ast.unparse(node.value)}"))
    return found


def test_only_config_and_plan_compare_with_auto():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
             for path in sorted(PACKAGE.rglob("*.py")) if not reads_auto(path.relative_to(PACKAGE).as_posix())
             for line, text in auto_comparisons(path.read_text())]
    assert not found, ("these modules read `auto` themselves; resolve it in plan.resolve (a run decision) or in "
                       "the config package (what the key's auto means) and pass the result:\n" + "\n".join(found))


def test_config_and_plan_are_where_auto_is_read():
    """The two readers are where they are said to be (a renamed file would leave the scan above without them)."""
    for name in READERS:
        assert any(auto_comparisons(source) for source in reader_sources(name)), name


def test_every_form_of_comparison_is_found_and_mentions_are_not():
    compared = '''
MODE = "auto"
MODES: tuple = ("auto", "gpu")
from meshtune.config import without_autos
a == "auto"
"auto" != b
c in ("auto", "gpu")
d not in ["auto"]
e is "auto"
f in frozenset({"auto"})
g == MODE
h in MODES
match i:
    case "auto":
        pass
'''
    assert [line for line, _ in auto_comparisons(compared)] == list(range(5, 13)) + [14]
    mentioned = '''
values = {"template": "auto"}
write("auto")
manifest.get("template", "auto")
text = f"set it to 0 or \\"auto\\""
a == "automatic"
'''
    assert auto_comparisons(mentioned) == []
