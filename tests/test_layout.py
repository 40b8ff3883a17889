"""The tree tells the architecture: imports point down the layers, with no circle, even lazily.

The graph is read from the source (``ast``), so it counts every import a module can run: at
module level, inside functions (the lazy imports that keep ``grpo-fast --help`` fast), and the
modules a package's ``lazy_exports`` or a ``LazyModule`` stand in for; only ``if TYPE_CHECKING:``
blocks, which never run, are left out. A package's ``__init__`` is a node of its own; importing
a submodule does not count as importing its package's names.
"""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "grpo_fast")

# Who may not import whom: (modules under this prefix, prefixes they must never import).
# The trainer's core is config, sections, checks, choices, trl_names, runtime and distributed; each side's folder
# says the same in its __init__ docstring.
SIDES = ("grpo_fast.trainer.model", "grpo_fast.trainer.rollout", "grpo_fast.trainer.update", "grpo_fast.trainer.run")
TOP = ("grpo_fast.trainer.grpo",)
CORE = tuple(
    f"grpo_fast.trainer.{name}"
    for name in ("config", "sections", "checks", "choices", "trl_names", "runtime", "distributed")
)
FORBIDDEN = [
    ("grpo_fast.kernels", ("grpo_fast.ops", "grpo_fast.trainer", "grpo_fast.reference")),
    ("grpo_fast.ops", ("grpo_fast.trainer", "grpo_fast.integrations")),
    ("grpo_fast.reference", ("grpo_fast.ops", "grpo_fast.kernels", "grpo_fast.trainer")),
    ("grpo_fast.sandbox", ("grpo_fast.trainer", "grpo_fast.rewards", "grpo_fast.tools", "grpo_fast.tasks")),
    ("grpo_fast.rewards", ("grpo_fast.trainer", "grpo_fast.tasks", "grpo_fast.tools")),
    ("grpo_fast.tools", ("grpo_fast.trainer", "grpo_fast.tasks")),
    ("grpo_fast.environments", ("grpo_fast.trainer", "grpo_fast.tasks", "grpo_fast.integrations")),
    ("grpo_fast.tasks", ("grpo_fast.trainer",)),
    ("grpo_fast.integrations", ("grpo_fast.trainer",)),
    ("grpo_fast.packing", ("grpo_fast.trainer", "grpo_fast.integrations")),
    ("grpo_fast.model_files", ("grpo_fast.trainer", "grpo_fast.integrations", "grpo_fast.ops", "grpo_fast.tasks")),
    *((core, SIDES + TOP) for core in CORE),
    (
        "grpo_fast.trainer.model",
        ("grpo_fast.trainer.rollout", "grpo_fast.trainer.update", "grpo_fast.trainer.run", *TOP),
    ),
    ("grpo_fast.trainer.rollout", ("grpo_fast.trainer.update", "grpo_fast.trainer.run", *TOP)),
    ("grpo_fast.trainer.update", ("grpo_fast.trainer.run", *TOP)),
    ("grpo_fast.trainer.run", TOP),
]

LIMITS = {"grpo_fast.trainer.grpo": 350}
# The GRPO step: the trainer and the sides it runs a step with. A strategy (update/strategy.py)
# is all it knows of how advantages are made; PPO's critic is one, in grpo_fast/bench/ppo.py.
STEP = ("grpo_fast.trainer.grpo", "grpo_fast.trainer.update", "grpo_fast.trainer.run")
PPO_WORDS = re.compile(r"(?<![a-z])ppo|ppo(?![a-z])|critic|value[ _](head|model)|\bgae\b", re.IGNORECASE)
MAX_LINES = 500


def module_files() -> dict:
    """{dotted module name: path} of every module of grpo_fast."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: str, modules: dict) -> set:
    """The grpo_fast modules that the module at ``path`` can import."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skipped = {id(n) for block in ast.walk(tree) if _type_checking(block) for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # a submodule by that name, else a name of the module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("lazy_exports", "LazyModule"):
            for constant in ast.walk(node):  # the modules named by string
                if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                    found.add(constant.value.split(":")[0])
    return {name for name in found if name in modules}


@pytest.fixture(scope="module")
def graph() -> dict:
    modules = module_files()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_circle(graph):
    """No module reaches itself through imports (depth-first search with an explicit path)."""
    state, circles = {}, []

    def visit(node: str, path: list) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_module_imports_a_layer_above_it(graph):
    bad = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for prefix, above in FORBIDDEN
        if under(module, prefix)
        for target in targets
        if any(under(target, a) for a in above)
    ]
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_see_the_imports_they_judge(graph):
    """The graph holds what the rules read: the trainer's imports, lazy ones included."""
    assert "grpo_fast.trainer.grpo" in graph["grpo_fast.trainer"]  # lazy_exports
    assert "grpo_fast.trainer.rollout.engines" in graph["grpo_fast.trainer.grpo"]
    assert "grpo_fast.trainer.run.evaluation" in graph["grpo_fast.cli"]  # inside a function
    assert any(under(m, "grpo_fast.trainer.rollout") for m in graph) and all(
        under(prefix, "grpo_fast") for prefix, _ in FORBIDDEN
    )


def test_the_grpo_step_names_no_ppo_concept(graph):
    """Neither code nor comment of the step's modules names PPO or its critic, nor imports the
    module that does ("supported" is no match; "PPOTrainer" and "ppo_kl" would be)."""
    assert PPO_WORDS.search("PPOTrainer value_model ppo_kl") and not PPO_WORDS.search("unsupported")
    step = [name for name in graph if any(under(name, prefix) for prefix in STEP)]
    paths = module_files()
    found = [
        f"{name}:{number}: {line.strip()}"
        for name in step
        for number, line in enumerate(open(paths[name], encoding="utf-8"), 1)
        if PPO_WORDS.search(line)
    ]
    found += [f"{name} imports {target}" for name in step for target in graph[name] if "ppo" in target]
    assert "grpo_fast.trainer.update.strategy" in graph["grpo_fast.trainer.grpo"]
    assert not found, "\n".join(found)


def test_the_trainer_sides_are_folders_with_a_docstring_each():
    """Each side's __init__ says in a paragraph what it holds and what it may import."""
    for side in SIDES:
        init = os.path.join(ROOT, *side.split("."), "__init__.py")
        doc = ast.get_docstring(ast.parse(open(init, encoding="utf-8").read()))
        assert doc and "May import" in doc, side


def test_the_sandbox_needs_only_the_standard_library():
    """Its bootstrap runs as ``python -I -S`` and imports its siblings by bare name, before
    anything else is importable; the caller's side is as plain, so that the sandbox runs from
    any interpreter (tests/test_sandbox.py runs it as uids that may not read site-packages)."""
    folder = os.path.join(PACKAGE, "sandbox")
    siblings = {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}
    outside = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for module in found:
                top = module.split(".")[0]
                if not (top in sys.stdlib_module_names or top in siblings or module.startswith("grpo_fast.sandbox")):
                    outside.append(f"{name}: {module}")
    assert siblings >= {"_boot", "_confine", "_judge", "runner"} and not outside, outside


def test_modules_stay_readable_sizes():
    over = []
    for name, path in module_files().items():
        lines = sum(1 for _ in open(path, encoding="utf-8"))
        limit = LIMITS.get(name, MAX_LINES)
        if lines > limit:
            over.append(f"{name}: {lines} lines (limit {limit})")
    assert not over, "\n".join(over)
