"""The house's import rules, read from the source (no module is imported).

Every `import` and `from ... import` in onecall/ counts: at module level, inside functions (lazy
imports), and under `if TYPE_CHECKING:`; a circle through any of them is a circle a reader has to
hold in their head. What must hold:

1. no import circle among onecall's modules, within a package or across packages;
2. formats/ (files -> tensors and a config) imports nothing of kernels/, engine/, sampling/, text/,
   tools/, server/ or lab/, and of model/ only model/config.py (the ModelConfig it builds);
3. kernels/ (how an op runs) imports nothing of model/, loading/, formats/ (but the quant containers
   formats/quants.py it packs), engine/, server/;
4. model/ (the network) imports nothing of engine/, sampling/, text/, tools/, server/ or lab/, nothing
   of formats/ or loading/, and of kernels/ only the interface (kernels/ops.py, kernels/select.py);
5. loading/ (where formats, model and kernels meet) imports nothing of engine/ and above;
6. text/ imports nothing of engine/, tools/, server/ or lab/; tools/ nothing of server/ or lab/;
   engine/ nothing of server/, lab/ or cli/.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "onecall"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The onecall modules `name` imports anywhere in its file (a package import of a module counts
    as that module: `from onecall.model import rope` -> onecall.model.rope)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _violations(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name == f"onecall.{package}" or name.startswith(f"onecall.{package}.")
        for target in targets
        if any(target == f"onecall.{f}" or target.startswith(f"onecall.{f}.") for f in forbidden)
        and target not in {f"onecall.{a}" for a in allowed}
    )


def test_the_graph_is_read_at_all() -> None:
    """Guards the rules below against a parser that finds nothing."""
    assert "onecall.model.config" in GRAPH["onecall.formats.hf_config"]
    assert "onecall.engine.tp.workers" in GRAPH["onecall.engine.engine"]  # a lazy import counts
    assert len(MODULES) > 100


def test_no_import_circle_anywhere() -> None:
    assert _cycles() == []


def test_a_planted_circle_would_be_found() -> None:
    GRAPH["onecall.model.config"].add("onecall.model.decoder")  # decoder imports config
    try:
        assert any("onecall.model.config" in c and "onecall.model.decoder" in c for c in _cycles())
    finally:
        GRAPH["onecall.model.config"].discard("onecall.model.decoder")


def test_formats_know_nothing_of_kernels_or_the_network() -> None:
    forbidden = ("kernels", "engine", "sampling", "text", "tools", "server", "lab", "model")
    assert _violations("formats", forbidden, allowed=("model.config",)) == []


def test_kernels_know_no_model() -> None:
    forbidden = ("model", "loading", "engine", "server", "formats", "sampling", "text")
    assert _violations("kernels", forbidden, allowed=("formats.quants",)) == []


def test_the_network_asks_kernels_through_their_interface_only() -> None:
    """model/ reaches kernels through kernels/ops.py and kernels/select.py, never their internals
    (kernels/cpu/native.py, fast_linear.py, cuda/...), and knows no file format."""
    kernels = [m for m in MODULES if m.startswith("onecall.kernels.")]
    internals = tuple(m.removeprefix("onecall.") for m in kernels if m not in _KERNEL_INTERFACE)
    assert "kernels.cpu.native" in internals and "kernels.ops" not in internals  # the split is real
    assert _violations("model", (*internals, "formats", "loading")) == []


_KERNEL_INTERFACE = {"onecall.kernels.ops", "onecall.kernels.select"}


def test_loading_sits_below_the_engine() -> None:
    forbidden = ("engine", "sampling", "text", "tools", "server", "lab", "cli")
    assert _violations("loading", forbidden) == []


def test_the_layers_flow_one_way() -> None:
    assert _violations("model", ("engine", "sampling", "text", "tools", "server", "lab", "cli")) == []
    assert _violations("text", ("engine", "tools", "server", "lab", "cli")) == []
    assert _violations("tools", ("server", "lab", "cli")) == []
    assert _violations("engine", ("server", "lab", "cli")) == []
