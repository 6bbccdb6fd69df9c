"""The lab is built on onecall's public API: it imports nothing from onecall but the package's own
`__all__`, its own modules, and the engine flags it shares with the CLI; it never reads `.engine`.

Every module under onecall/lab is parsed (ast), imports inside functions and TYPE_CHECKING blocks
included, so a new `from onecall.engine.engine import X` anywhere in the lab fails here. Beside it:
`__all__` is sorted and every name in it resolves, `import onecall` stays light, and `LLM.info`
(what the lab reads instead of the engine) agrees with figures computed from the engine itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import onecall
from onecall.llm import LLM
from tests.helpers.tiny_engine import tiny_engine

LAB = Path(onecall.__file__).parent / "lab"
# The one module outside onecall.lab that the lab may import: the flags every command shares
# (the CLI imports it too; the lab and the CLI do not import each other).
SHARED_FLAGS = "onecall.engine_flags"


def lab_modules() -> list[Path]:
    return sorted(LAB.rglob("*.py"))


def onecall_imports(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of an onecall module in `source`; names is [] for
    `import onecall...`."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "onecall":
                found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):  # relative: `from . import x` / `from .base import y`
            found.append((node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "onecall"]
    return found


def violations(source: str) -> list[str]:
    """What in a lab module's source reaches past the public API (empty: nothing)."""
    public = set(onecall.__all__)
    bad = []
    for line, module, names in onecall_imports(source):
        if module == "onecall":
            bad += [f"line {line}: onecall.{n} is not in onecall.__all__" for n in names if n not in public]
        elif module.startswith("."):
            bad.append(f"line {line}: relative import {module!r} (write onecall.lab.* out)")
        elif not (module.startswith("onecall.lab.") or module in ("onecall.lab", SHARED_FLAGS)):
            bad.append(f"line {line}: imports {module}, which is not onecall's public API")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "engine":
            bad.append(f"line {node.lineno}: reads .engine (use LLM's public methods and LLM.info)")
        # `import onecall` then onecall.X: X must be public too (dunders such as __version__ aside)
        on_package = isinstance(node.value, ast.Name) and node.value.id == "onecall"
        if on_package and node.attr not in public and not node.attr.startswith("__"):
            bad.append(f"line {node.lineno}: onecall.{node.attr} is not in onecall.__all__")
    return bad


def test_the_lab_imports_only_onecalls_public_names() -> None:
    modules = lab_modules()
    assert len(modules) >= 10, modules  # base, cli, runner, report, plots, the experiments, ...
    problems = {
        str(path.relative_to(LAB.parent.parent)): found
        for path in modules
        if (found := violations(path.read_text()))
    }
    assert problems == {}


def test_the_check_catches_a_reach_inside() -> None:
    """The check above is real: an import from inside onecall, a private name, or a read of the
    engine, added to a real lab module, is reported with its line."""
    source = (LAB / "experiments" / "memory.py").read_text()
    assert violations(source) == []
    for added, expected in [
        ("from onecall.engine.engine import RequestOutput", "imports onecall.engine.engine"),
        ("from onecall.text.templates import get_named_template", "imports onecall.text.templates"),
        ("import onecall.llm", "imports onecall.llm"),
        ("from onecall import EngineConfig", "onecall.EngineConfig is not in onecall.__all__"),
        ("from .base import SeedRow", "relative import '.base'"),
        ("import onecall\nx = onecall.config", "onecall.config is not in onecall.__all__"),
    ]:
        found = violations(source + "\n" + added + "\n")
        assert len(found) == 1 and expected in found[0], (added, found)
    # inside a function, and a read of the engine rather than an import
    inside = source + (
        "\n\ndef later(ctx: LabContext) -> None:\n"
        "    from onecall.engine.engine import Engine\n"
        "    print(ctx.llm.engine.parts, Engine)\n"
    )
    found = violations(inside)
    assert len(found) == 2 and "imports onecall.engine.engine" in found[0] and "reads .engine" in found[1]


def test_the_public_api_is_sorted_and_resolves() -> None:
    assert onecall.__all__ == sorted(onecall.__all__)
    assert len(set(onecall.__all__)) == len(onecall.__all__)
    for name in onecall.__all__:
        assert getattr(onecall, name) is not None, name
    assert not hasattr(onecall, "EngineConfig")


def test_import_onecall_stays_light() -> None:
    """The public names load lazily: importing the package loads no torch and no subpackage."""
    code = (
        "import sys, onecall;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('onecall.engine', 'onecall.text',"
        " 'onecall.model', 'onecall.server', 'onecall.lab'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_llm_info_agrees_with_the_engine() -> None:
    """LLM.info, what the lab reads, against figures taken from the engine's own tensors."""
    engine = tiny_engine()
    llm = LLM(engine=engine)
    info = llm.info
    assert isinstance(info, onecall.ModelInfo) and llm.info is info  # computed once
    k = engine.parts.kv_cache.k  # (layers, slots, kv_heads, head_dim)
    assert info.kv_bytes_per_token == 2 * k[:, 0].numel() * k.element_size()
    assert (info.num_hidden_layers, info.num_key_value_heads, info.head_dim) == (k.shape[0], *k.shape[2:])
    assert info.weight_bytes_per_step == llm.weight_bytes_read(1) > 0
    assert info.decode_step_bytes(10) == info.weight_bytes_per_step + 10 * info.kv_bytes_per_token
    assert (info.device, info.dtype, info.kv_cache_dtype) == ("cpu", "float32", "float32")
    assert info.model_name == engine.parts.model_name and info.kernels == engine.parts.kernels
    assert info.vocab_size == engine.tokenizer.vocab_size  # the tiny model's embedding: its tokenizer's
    assert info.max_model_len == engine.max_model_len
