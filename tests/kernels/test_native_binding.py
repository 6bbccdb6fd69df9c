"""kernels.h, the native kernels' one C declaration, and what holds the rest to it (native_abi.py).

- the parser: the real header (every declaration has its comment), a small header read exactly, and
  what it must refuse, each refusal naming the line;
- the functions: every prototype bound from the built library with the ctypes signature derived from
  it, the library exporting nothing else; a header function the library lacks is a load error, a call
  with another argument count a TypeError, an undeclared name an AttributeError;
- the structs: the ctypes mirrors match the header and the compiled layout; a mirror with a wrong field
  type, name, order or packing, a header struct without a layout row or a mirror: a RuntimeError
  naming the struct and field;
- the C: a definition that differs from its prototype, or an export without one, does not build;
- the Python: every direct call of a kernel in onecall/ passes as many arguments as its prototype.
"""

from __future__ import annotations

import ast
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from onecall import envs
from onecall.kernels.cpu import native, native_abi, native_build
from onecall.kernels.cpu.native_abi import CType, HeaderError, KernelLibrary, Variable, parse_header

LIB = native.load()
HEADER = native_build._HEADER
ONECALL = Path(native_abi.__file__).parents[2]


@pytest.fixture
def lib() -> KernelLibrary:
    if LIB is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    return LIB


@pytest.fixture
def compiler() -> str:
    try:
        return native_build._compiler()
    except native_build._Unavailable as e:
        pytest.skip(str(e))


def _rebind(lib: KernelLibrary, header_text: str) -> KernelLibrary:
    """The built library bound again from another header's text (the same file: nothing is rebuilt)."""
    return KernelLibrary(Path(lib._name), parse_header(header_text))


def test_the_library_builds_wherever_it_can_run(compiler: str) -> None:
    """load() falls back to torch when the build fails, and the kernel tests skip; where the CPU and a
    compiler can build it, a failure is a bug in csrc (a definition that is not its prototype, an
    export without one): a failure here, not a skip."""
    if envs.disable_native_kernels() or not set(native_build._REQUIRED_CPU_FLAGS) <= native.cpu_flags():
        pytest.skip("the kernels cannot run here")
    assert LIB is not None, native.unavailable_reason()


# ---- the parser ----------------------------------------------------------------------------------
def test_the_real_header_declares_every_export_with_its_comment() -> None:
    header = native_abi.read_header(HEADER)
    assert set(header.structs) == {"Q4Weight", "DecodeLayer"}
    assert {"onecall_q4_gemm", "onecall_decode_layers", "onecall_struct_layout"} <= set(header.functions)
    for f in header.functions.values():
        assert f.doc, f"{f.name} (kernels.h:{f.line}) has no comment directly above it"
        if f.restype != CType("void"):  # what it returns is documented: the error codes, or the count
            assert "0 on success" in f.doc or "returns" in f.doc, f.name
    for s in header.structs.values():
        assert s.doc, f"struct {s.name} has no comment directly above it"
    assert header.functions["onecall_q4_gemm"].params[3] == Variable(CType("uint8_t", 1, const=True), "qs")
    assert header.structs["DecodeLayer"].fields[-1] == Variable(CType("Q4Weight"), "down")


def test_the_parser_reads_its_subset_exactly() -> None:
    text = """/* guard */
#ifndef G
#define G
#include <stdint.h>

/* a pair */
typedef struct {
    const float *a, **b; /* a trailing comment */
    int64_t n;
} Pair;
/* f's doc */
int64_t onecall_f(const Pair *p, float x, void *out);

void onecall_g(void);
#endif /* G */
"""
    h = parse_header(text)
    assert list(h.structs) == ["Pair"] and list(h.functions) == ["onecall_f", "onecall_g"]
    pair = h.structs["Pair"]
    assert pair.fields == (
        Variable(CType("float", 1, True), "a"),
        Variable(CType("float", 2, True), "b"),
        Variable(CType("int64_t"), "n"),
    )
    assert pair.doc == "/* a pair */"
    f, g = h.functions["onecall_f"], h.functions["onecall_g"]
    assert f.doc == "/* f's doc */" and g.doc is None and g.params == ()
    assert str(f) == "int64_t onecall_f(const Pair *p, float x, void *out)"
    assert [native_abi.ctype(p.type) for p in f.params] == [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    assert native_abi.ctype(f.restype) is ctypes.c_int64 and native_abi.ctype(g.restype) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("#define N 4", r":1: a directive it does not read: '#define N 4'"),
        ("#include <stdio.h>", "a directive it does not read"),
        ("unsigned int onecall_a(int x);", r":1: expected a type .* found 'unsigned'"),
        ("long onecall_a(int x);", "expected a type .* found 'long'"),
        ("\n\nint helper(int x);", r":3: helper: every function the header declares is an export named onecall_"),
        ("int onecall_a(int);", "expected a parameter name, found '\\)'"),
        ("int onecall_a();", "expected a type .* found '\\)'"),
        ("int onecall_a(int x[4]);", "expected '\\)', found '\\['"),
        ("int onecall_a(int (*f)(int));", "expected a parameter name, found '\\('"),
        ("int onecall_a(const float *const p);", "expected a parameter name, found 'const'"),
        ("static inline int onecall_a(int x) { return x; }", "found 'static'"),
        ("int onecall_a(int x) { return x; }", "expected ';', found '{'"),
        ("int onecall_a(int x)", "expected ';', found 'the end of the file'"),
        ("struct S { int x; };", "found 'struct'"),
        ("enum E { A };", "found 'enum'"),
        ("typedef struct { int x : 3; } S;", "expected ';', found ':'"),
        ("typedef struct { void v; } S;", "field v is void"),
        ("typedef struct { int x; int x; } S;", "struct S is declared twice or repeats a field"),
        ("typedef struct { int x; } S;\nint onecall_a(S s);", r":2: onecall_a: parameter s is S by value"),
        ("typedef struct { int x; } S;\nS onecall_a(int x);", "onecall_a returns a struct by value"),
        ("int onecall_a(Later *p);\ntypedef struct { int x; } Later;", "expected a type .* found 'Later'"),
        ("int onecall_a(int x);\nint onecall_a(int x);", r":2: onecall_a is declared twice"),
        ("int onecall_a(int x); /* unterminated", "found '/'"),
        ("int onecall_a(\n#define Y\nint x);", r"expected a type .* found '#'"),
    ],
)
def test_the_parser_refuses_what_it_does_not_read(text: str, match: str) -> None:
    with pytest.raises(HeaderError, match=match):
        parse_header(text)


# ---- the functions ---------------------------------------------------------------------------------
def test_every_declared_function_is_bound_with_its_derived_signature(lib: KernelLibrary) -> None:
    assert lib.header == native_abi.read_header(HEADER)
    for f in lib.header.functions.values():
        fn = getattr(lib, f.name)
        assert fn.argtypes == [native_abi.ctype(p.type) for p in f.params], f.name
        assert fn.restype is native_abi.ctype(f.restype), f.name


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm to list the library's symbols")
def test_the_library_exports_exactly_what_the_header_declares(lib: KernelLibrary) -> None:
    listing = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listing.stdout.splitlines() if line.split()[-1].startswith("onecall_")}
    assert exported == set(lib.header.functions)


def test_a_function_the_library_lacks_fails_the_load(lib: KernelLibrary) -> None:
    text = HEADER.read_text().replace("#endif", "/* not there */\nint onecall_not_there(int x);\n#endif")
    with pytest.raises(RuntimeError, match=r"kernels.h declares onecall_not_there, but .*\.so does not export it"):
        _rebind(lib, text)


def test_calls_take_exactly_the_declared_arguments(lib: KernelLibrary) -> None:
    """ctypes would pass a surplus argument on silently (cdecl); KernelLibrary makes it a TypeError."""
    out = (ctypes.c_int64 * 1)()
    x = (ctypes.c_float * 2)(1.0, 3.0)
    assert lib.onecall_argmax_rows(x, 1, 2, out, 1) == 0 and out[0] == 1
    with pytest.raises(TypeError, match="takes 5 arguments \\(6 given\\)"):
        lib.onecall_argmax_rows(x, 1, 2, out, 1, 0)
    with pytest.raises(TypeError, match="takes 5 arguments \\(4 given\\)"):
        lib.onecall_argmax_rows(x, 1, 2, out)
    # a deliberately wrong declaration: the header says 3 parameters, native.py's call passes 5
    text = HEADER.read_text()
    right = "int onecall_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out, int num_threads);"
    assert right in text
    wrong = _rebind(lib, text.replace(right, "int onecall_argmax_rows(const float *x, int64_t M, int64_t N);"))
    with pytest.raises(TypeError, match="takes 3 arguments \\(5 given\\)"):
        wrong.onecall_argmax_rows(x, 1, 2, out, 1)


def test_an_undeclared_name_is_refused_even_where_the_symbol_exists(lib: KernelLibrary) -> None:
    with pytest.raises(AttributeError, match="onecall_q4_gemm_v2: not declared in kernels.h"):
        lib.onecall_q4_gemm_v2  # noqa: B018
    text = HEADER.read_text()
    silu = "void onecall_silu_mul(const float *y, int64_t M, int64_t I, float *out);"
    assert silu in text
    without = _rebind(lib, text.replace(silu, ""))
    with pytest.raises(AttributeError, match="onecall_silu_mul: not declared in kernels.h"):
        without.onecall_silu_mul  # noqa: B018


# ---- the structs -----------------------------------------------------------------------------------
def test_the_mirrors_match_the_header_and_the_compiled_layout(lib: KernelLibrary) -> None:
    native_abi.check_structs(lib, lib.header, native_abi.MIRRORS)  # as load() did
    rows = native_abi._layout_rows(lib, lib.header)
    assert rows["DecodeLayer"] == (ctypes.sizeof(native.DecodeLayer), 8)
    assert rows["DecodeLayer.qkv"] == (native.DecodeLayer.qkv.offset, ctypes.sizeof(native.Q4Weight))
    assert native.Q4Weight is native_abi.Q4Weight and native.DecodeLayer is native_abi.DecodeLayer


def _q4_fields(**changes: object) -> list[tuple[str, object]]:
    fields = [(f[0], changes.get(f[0], f[1])) for f in native_abi.Q4Weight._fields_]
    return [(n, t) for n, t in fields if t is not None]


def _mirror(name: str, fields: list[tuple[str, object]], pack: int = 0) -> type[ctypes.Structure]:
    body: dict[str, object] = {"_fields_": fields}
    if pack:
        body["_pack_"] = pack
    return type(name, (ctypes.Structure,), body)


_LAST_Q4 = native_abi.Q4Weight._fields_[-1][0]  # a mirror without it: nothing else moves
_Q4_SIZE = ctypes.sizeof(native_abi.Q4Weight)


def _decode_fields(**changes: object) -> list[tuple[str, object]]:
    return [(f[0], changes.get(f[0], f[1])) for f in native_abi.DecodeLayer._fields_]


@pytest.mark.parametrize(
    ("q4", "layer", "match"),
    [
        (_q4_fields(n=ctypes.c_int32), None, r"Q4Weight\.n: kernels.h declares int64_t .* the ctypes mirror has c_int"),
        # the same size as the float it replaces: only the header's types tell
        (None, _decode_fields(softcap=ctypes.c_int32), r"DecodeLayer\.softcap: kernels.h declares float"),
        (_q4_fields(**{_LAST_Q4: None}), None, rf"Q4Weight\.{_LAST_Q4}: in kernels.h, missing from the ctypes mirror"),
        (_q4_fields() + [("extra", ctypes.c_int64)], None, r"Q4Weight\.extra: the ctypes mirror's field where"),
        (None, [f if f[0] != "window" else ("sliding_window", f[1]) for f in _decode_fields()],
         r"DecodeLayer\.sliding_window: the ctypes mirror's field where kernels.h has window"),
        # right names and types, packed: the compiled layout tells, at the first field that moves
        (None, "pack", rf"DecodeLayer\.qkv: offset, size \(48, {_Q4_SIZE}\) in C, \(44, {_Q4_SIZE}\) in ctypes"),
    ],
)  # fmt: skip
def test_a_mirror_that_disagrees_is_a_load_error(lib: KernelLibrary, q4: object, layer: object, match: str) -> None:
    mirrors = dict(native_abi.MIRRORS)
    if isinstance(q4, list):
        mirrors["Q4Weight"] = _mirror("Q4Weight", q4)
    if isinstance(layer, list):
        mirrors["DecodeLayer"] = _mirror("DecodeLayer", layer)
    elif layer == "pack":
        mirrors["DecodeLayer"] = _mirror("DecodeLayer", _decode_fields(), pack=4)
    with pytest.raises(RuntimeError, match=match):
        native_abi.check_structs(lib, lib.header, mirrors)


def test_a_header_struct_that_disagrees_with_the_compiled_one_is_a_load_error(lib: KernelLibrary) -> None:
    """A header and mirror that agree with each other but not with what was compiled (the layout
    table), a header struct without a layout row, and one without a mirror."""
    text = HEADER.read_text()
    assert "    int64_t n, k, f16;\n" in text
    narrow = parse_header(text.replace("    int64_t n, k, f16;\n", "    int32_t n, k, f16;\n"))
    q4 = _mirror("Q4Weight", _q4_fields(n=ctypes.c_int32, k=ctypes.c_int32, f16=ctypes.c_int32))
    layer = _mirror("DecodeLayer", _decode_fields(qkv=q4, o=q4, gate_up=q4, down=q4))
    with pytest.raises(RuntimeError, match=r"Q4Weight\.n: offset, size \(32, 8\) in C, \(32, 4\) in ctypes"):
        native_abi.check_structs(lib, narrow, {"Q4Weight": q4, "DecodeLayer": layer})
    extra = parse_header(text.replace("#endif", "/* one more */\ntypedef struct { int64_t a; } Extra;\n#endif"))
    mirrors = {**native_abi.MIRRORS, "Extra": _mirror("Extra", [("a", ctypes.c_int64)])}
    with pytest.raises(RuntimeError, match=r"Extra\.a: declared in kernels.h, but onecall_struct_layout .* no row"):
        native_abi.check_structs(lib, extra, mirrors)
    with pytest.raises(RuntimeError, match="kernels.h declares struct Extra, which has no ctypes mirror"):
        native_abi.check_structs(lib, extra, native_abi.MIRRORS)
    with pytest.raises(RuntimeError, match="ctypes mirror Extra: kernels.h declares no struct Extra"):
        native_abi.check_structs(lib, lib.header, mirrors)


# ---- the C -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "match"),
    [
        # a definition that is not its prototype (I int64_t there)
        ("void onecall_silu_mul(const float *y, int64_t M, int I, float *out) { (void)y, (void)M, (void)I; }",
         "previous declaration"),  # of onecall_silu_mul: "conflicting types for ..." precedes it
        # an export kernels.h does not declare
        ("int onecall_extra(int x) { return x; }", "no previous prototype for (function )?.onecall_extra."),
    ],
)  # fmt: skip
def test_the_compiler_holds_the_sources_to_the_header(compiler: str, tmp_path: Path, source: str, match: str) -> None:
    shutil.copy(HEADER, tmp_path / "kernels.h")
    (tmp_path / "k.c").write_text(f'#include "kernels.h"\n{source}\n')
    with pytest.raises(native_build._Unavailable, match=match):
        native_build._compile(compiler, [tmp_path / "k.c"], tmp_path / "k.so")


# ---- the Python ------------------------------------------------------------------------------------
def test_every_call_site_passes_the_declared_number_of_arguments() -> None:
    """Every `x.onecall_name(...)` in onecall/: the name is declared and the arguments are as many as
    its parameters (a call through another name is checked when it runs: see the TypeError above)."""
    functions = native_abi.read_header(HEADER).functions
    checked = []
    for path in sorted(ONECALL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if not name.startswith("onecall_"):
                continue
            where = f"{path.relative_to(ONECALL.parent)}:{node.lineno}"
            assert name in functions, f"{where} calls {name}, which kernels.h does not declare"
            assert not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args), where
            assert len(node.args) == len(functions[name].params), (
                f"{where} passes {len(node.args)} arguments to {functions[name]}"
            )
            checked.append(name)
    assert {"onecall_decode_layers", "onecall_paged_decode_attention", "onecall_rope_store"} <= set(checked)
