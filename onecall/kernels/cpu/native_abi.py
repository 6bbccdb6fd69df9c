"""The native kernels' C interface, read from its one declaration, csrc/kernels.h, and held to it.

kernels.h declares every function the library exports and every struct Python fills. At load
(native_build.py) this module:

1. parses the header (`read_header`: a small, strict parser for the C subset below);
2. binds the library's functions from the parsed prototypes (`KernelLibrary`): each one's ctypes
   argtypes and restype are derived from its prototype, so there is no second list of signatures to
   drift; a function the header declares but the library lacks is a RuntimeError; a function the
   header does not declare is an AttributeError when Python asks for it; a call with another number of
   arguments than the prototype's is a TypeError (ctypes checks it: see KernelLibrary);
3. checks the ctypes mirrors of the header's structs (`Q4Weight`, `DecodeLayer`; `check_structs`):
   field names, order and ctypes types against the header's fields, then sizes, alignments and
   offsets against what this compiler laid out (the library's onecall_struct_layout, csrc/layout.c).
   A mismatch is a RuntimeError naming the struct and the field.

The C side is held to the header by the compiler: every source includes it (a definition that differs
from its prototype does not compile) and the build passes -Werror=missing-prototypes (no function is
exported without a prototype there).

The C subset the parser reads (anything else is a HeaderError naming the line):

    header      := { comment | directive | struct | prototype }
    directive   := #ifndef NAME | #define NAME | #endif | #include <stdint.h>
    struct      := typedef struct { field ; { field ; } } NAME ;
    field       := type declarator { , declarator }
    prototype   := type declarator ( void | param { , param } ) ;     the NAME starts with onecall_
    param       := type declarator
    declarator  := { * } NAME
    type        := [ const ] BASE
    BASE        := void char int float double size_t [u]int{8,16,32,64}_t, or a struct declared above

A struct is passed by pointer only (a parameter or return value of struct type is refused); every
parameter is named; no arrays, function pointers, enums, unions, macros with values, `unsigned`/`long`,
bit fields or `* const`. Pointers cross as addresses (ctypes c_void_p): a tensor's data_ptr(), None
for NULL, a ctypes array. The comment directly above a declaration (ending on the line before it) is
its doc; tests/kernels/test_native_binding.py checks that every declaration has one.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

# C base type -> ctypes type by value (void: a function returning nothing)
_SCALARS: dict[str, Any] = {
    "void": None,
    "char": ctypes.c_char,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "size_t": ctypes.c_size_t,
    **{f"{u}int{b}_t": getattr(ctypes, f"c_{u}int{b}") for u in ("", "u") for b in (8, 16, 32, 64)},
}
_KEYWORDS = {"const", "typedef", "struct", "union", "enum", "static", "inline", "extern", "unsigned", "signed",
             "long", "short", "volatile", "restrict", "register"}  # fmt: skip
_DIRECTIVE = re.compile(r"#\s*(ifndef\s+\w+|define\s+\w+|endif|include\s*<stdint\.h>)")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_TOKEN = re.compile(r"[A-Za-z_]\w*|\S")  # a word or any other single character
_SUBSET = " (the C subset kernels.h may use: onecall/kernels/cpu/native_abi.py's docstring)"


class HeaderError(RuntimeError):
    """kernels.h holds something outside the C subset the parser reads (native_abi's docstring)."""


@dataclass(frozen=True)
class CType:
    """A C type as the header spells it: `const float *` is CType("float", pointers=1, const=True)."""

    base: str
    pointers: int = 0
    const: bool = False

    def __str__(self) -> str:
        return f"{'const ' if self.const else ''}{self.base}{' ' + '*' * self.pointers if self.pointers else ''}"


@dataclass(frozen=True)
class Variable:
    """A parameter or a struct field."""

    type: CType
    name: str


@dataclass(frozen=True)
class Function:
    """A prototype: an exported function."""

    name: str
    restype: CType
    params: tuple[Variable, ...]
    line: int
    doc: str | None

    def __str__(self) -> str:
        params = ", ".join(f"{p.type}{'' if p.type.pointers else ' '}{p.name}" for p in self.params)
        return f"{self.restype}{'' if self.restype.pointers else ' '}{self.name}({params or 'void'})"

    def abi(self) -> tuple[tuple[str, int], ...]:
        """What a caller must agree on: the return and parameter types (const and names aside)."""
        return tuple((t.base, t.pointers) for t in (self.restype, *(p.type for p in self.params)))


@dataclass(frozen=True)
class Struct:
    """A `typedef struct { ... } name;`: a struct Python fills."""

    name: str
    fields: tuple[Variable, ...]
    line: int
    doc: str | None


@dataclass(frozen=True)
class Header:
    """What a header declares."""

    source: str  # the file's name, for messages
    functions: dict[str, Function]  # in the header's order
    structs: dict[str, Struct]


def read_header(path: Path) -> Header:
    """kernels.h (or another revision's) parsed; a HeaderError names the line it cannot read."""
    return parse_header(path.read_text(), path.name)


def parse_header(text: str, source: str = "kernels.h") -> Header:
    """The functions and structs `text` declares, in the C subset of this module's docstring."""
    return _Parser(text, source).parse()


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.source = source
        # the code's tokens ("#" for a directive) and their lines, as two lists: no object per token
        self.tokens: list[str] = []
        self.lines: list[int] = []
        self.comments: dict[int, str] = {}  # the line a comment ends on -> its text
        for m in _COMMENT.finditer(text):
            self.comments[text.count("\n", 0, m.end()) + 1] = m.group()
        code = _COMMENT.sub(lambda m: "\n" * m.group().count("\n") or " ", text)  # the lines kept
        for line, row in enumerate(code.split("\n"), 1):
            if row.lstrip().startswith("#"):
                if not _DIRECTIVE.fullmatch(row.strip()):
                    raise HeaderError(f"{source}:{line}: a directive it does not read: {row.strip()!r}{_SUBSET}")
                self.tokens.append("#")
                self.lines.append(line)
            elif row_tokens := _TOKEN.findall(row):
                self.tokens += row_tokens
                self.lines += [line] * len(row_tokens)
        self.i = 0
        self.functions: dict[str, Function] = {}
        self.structs: dict[str, Struct] = {}

    def error(self, message: str, line: int | None = None) -> HeaderError:
        if line is None:
            line = self.lines[min(self.i, len(self.lines) - 1)]
        return HeaderError(f"{self.source}:{line}: {message}{_SUBSET}")

    def parse(self) -> Header:
        while self.i < len(self.tokens):
            if self.tokens[self.i] == "#":
                self.i += 1
                continue
            line = self.lines[self.i]
            self.declaration(self.comments.get(line - 1), line)  # its doc: a comment ending just above
        return Header(self.source, self.functions, self.structs)

    # ---- tokens ----
    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        text = self.peek()
        if text is None or (expected is not None and text != expected):
            raise self.error(f"expected {expected or 'more'!r}, found {text or 'the end of the file'!r}")
        self.i += 1
        return text

    def name(self, what: str) -> str:
        text = self.peek()
        if text is None or not (text[0].isalpha() or text[0] == "_") or text in _KEYWORDS or text in _SCALARS:
            raise self.error(f"expected {what}, found {text or 'the end of the file'!r}")
        self.i += 1
        return text

    # ---- declarations ----
    def declaration(self, doc: str | None, line: int) -> None:
        if self.peek() == "typedef":
            self.struct(doc, line)
            return
        base = self.base()
        restype = CType(base.base, self.stars(), base.const)
        name = self.name("a function name")
        if not name.startswith("onecall_"):
            raise self.error(f"{name}: every function the header declares is an export named onecall_*")
        if restype.base in self.structs and not restype.pointers:
            raise self.error(f"{name} returns a struct by value")
        self.take("(")
        params: list[Variable] = []
        start = self.i
        if self.take() != "void" or self.peek() != ")":  # (void): no parameters
            self.i = start
            params.append(self.parameter(name))
            while self.peek() == ",":
                self.take(",")
                params.append(self.parameter(name))
        self.take(")")
        self.take(";")
        if name in self.functions:
            raise self.error(f"{name} is declared twice", line)
        self.functions[name] = Function(name, restype, tuple(params), line, doc)

    def struct(self, doc: str | None, line: int) -> None:
        self.take("typedef")
        self.take("struct")
        self.take("{")
        fields: list[Variable] = []
        while self.peek() != "}":
            base = self.base()
            fields.append(self.field(base))
            while self.peek() == ",":
                self.take(",")
                fields.append(self.field(base))
            self.take(";")
        self.take("}")
        name = self.name("the struct's typedef name")
        self.take(";")
        if not fields:
            raise self.error(f"struct {name} has no fields", line)
        if name in self.structs or len({f.name for f in fields}) != len(fields):
            raise self.error(f"struct {name} is declared twice or repeats a field", line)
        self.structs[name] = Struct(name, tuple(fields), line, doc)

    def base(self) -> CType:
        const = self.peek() == "const"
        if const:
            self.take()
        text = self.peek()
        if text not in _SCALARS and text not in self.structs:
            raise self.error(f"expected a type ({', '.join(_SCALARS)} or a struct declared above), found {text!r}")
        self.take()
        return CType(text, 0, const)

    def stars(self) -> int:
        n = 0
        while self.peek() == "*":
            self.take()
            n += 1
        return n

    def parameter(self, function: str) -> Variable:
        base = self.base()
        p = Variable(CType(base.base, self.stars(), base.const), self.name("a parameter name"))
        if not p.type.pointers and (p.type.base == "void" or p.type.base in self.structs):
            raise self.error(f"{function}: parameter {p.name} is {p.type} by value")
        return p

    def field(self, base: CType) -> Variable:
        f = Variable(CType(base.base, self.stars(), base.const), self.name("a field name"))
        if f.type.base == "void" and not f.type.pointers:
            raise self.error(f"field {f.name} is void")
        return f


def ctype(t: CType, mirrors: Mapping[str, type[ctypes.Structure]] | None = None) -> Any:
    """The ctypes type of a C type: c_void_p for any pointer, the scalar's own type, None for void, a
    struct's mirror (by value: only as a field)."""
    if t.pointers:
        return ctypes.c_void_p
    if t.base in _SCALARS:
        return _SCALARS[t.base]
    assert mirrors is not None and t.base in mirrors, f"no mirror for struct {t.base}"
    return mirrors[t.base]


class KernelLibrary(ctypes.CDLL):
    """A shared library with exactly the functions its header declares bound, their argtypes and
    restype derived from the prototypes. Asking for any other name is an AttributeError."""

    # ctypes checks a call's argument count against argtypes in full only for functions without the
    # cdecl flag: for cdecl ones it passes surplus arguments on (C varargs), so an extra argument would
    # be ignored silently. Outside 32-bit Windows the flag changes nothing else (libffi uses the
    # platform's one calling convention either way), and the kernels build only on Linux: clear it, so
    # a call with too many arguments is a TypeError as one with too few is.
    _func_flags_ = 0

    def __init__(self, path: Path, header: Header) -> None:
        super().__init__(str(path))  # OSError: not loadable
        self.header = header
        for f in header.functions.values():
            try:
                fn = self[f.name]
            except AttributeError:
                raise RuntimeError(f"{header.source} declares {f.name}, but {path.name} does not export it") from None
            fn.argtypes = [ctype(p.type) for p in f.params]
            fn.restype = ctype(f.restype)
            setattr(self, f.name, fn)

    def __getattr__(self, name: str) -> Any:  # only for names not bound in __init__
        header = self.__dict__.get("header")
        source = header.source if header else "the header"
        raise AttributeError(f"{name}: not declared in {source}, so not bound (declare it there to call it)")


# ---- the structs Python fills, mirrored (checked against kernels.h and the compiler at load) ----
class Q4Weight(ctypes.Structure):
    """kernels.h's Q4Weight: one projection of the native decode step, 4-bit, 5-bit or int8 groups, IQ4
    codes or 16-bit floats."""

    _fields_ = [
        ("qs", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("f16", ctypes.c_int64),
        ("q8_group", ctypes.c_int64),
        ("act8", ctypes.c_int64),
        ("q5", ctypes.c_int64),
        ("half", ctypes.c_int64),
        ("iq4", ctypes.c_int64),
        ("next", ctypes.c_void_p),
        ("kbits", ctypes.c_int64),
    ]


class DecodeLayer(ctypes.Structure):
    """kernels.h's DecodeLayer: a layer's two norm weights, its q/k norm weights (or NULL), its
    attention options (sliding window, logit soft-cap; 0 = none) and four projections."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("qkv", Q4Weight),
        ("o", Q4Weight),
        ("gate_up", Q4Weight),
        ("down", Q4Weight),
    ]


MIRRORS: dict[str, type[ctypes.Structure]] = {s.__name__: s for s in (Q4Weight, DecodeLayer)}


def check_structs(lib: KernelLibrary, header: Header, mirrors: Mapping[str, type[ctypes.Structure]]) -> None:
    """Each of the header's structs against its ctypes mirror, then against the library's layout table;
    a RuntimeError names the struct and the field that differ."""
    # 1. the same structs on both sides
    if unmirrored := sorted(header.structs.keys() - mirrors.keys()):
        raise RuntimeError(f"{header.source} declares struct {unmirrored[0]}, which has no ctypes mirror")
    if undeclared := sorted(mirrors.keys() - header.structs.keys()):
        raise RuntimeError(f"ctypes mirror {undeclared[0]}: {header.source} declares no struct {undeclared[0]}")
    # 2. each mirror's fields: the header's names, in its order, with their ctypes types
    for s in header.structs.values():
        mirror_fields: list[tuple[Any, ...]] = list(mirrors[s.name]._fields_)
        for want, got in zip_longest(s.fields, mirror_fields):
            if got is None:
                raise RuntimeError(f"{s.name}.{want.name}: in {header.source}, missing from the ctypes mirror")
            if want is None or got[0] != want.name or len(got) != 2:
                there = f"{header.source} has {want.name}" if want else f"{header.source} has no more fields"
                raise RuntimeError(f"{s.name}.{got[0]}: the ctypes mirror's field where {there}")
            expected = ctype(want.type, mirrors)
            if got[1] is not expected:
                raise RuntimeError(
                    f"{s.name}.{want.name}: {header.source} declares {want.type} (ctypes {expected.__name__}), "
                    f"the ctypes mirror has {got[1].__name__}"
                )
    if not header.structs:
        return
    # 3. offsets, sizes and alignments as this compiler laid them out (fields first: a packing or
    #    padding difference is named at the first field it moves)
    rows = _layout_rows(lib, header)
    for s in header.structs.values():
        mirror = mirrors[s.name]
        for f in s.fields:
            c = _row(rows, f"{s.name}.{f.name}", header)
            desc = getattr(mirror, f.name)
            if c != (desc.offset, desc.size):
                raise RuntimeError(f"{s.name}.{f.name}: offset, size {c} in C, {(desc.offset, desc.size)} in ctypes")
        c, py = _row(rows, s.name, header), (ctypes.sizeof(mirror), ctypes.alignment(mirror))
        if c != py:
            raise RuntimeError(f"{s.name}: sizeof, alignof {c} in C, {py} in the ctypes mirror")
    if rows:
        raise RuntimeError(f"onecall_struct_layout lists {', '.join(rows)}, which {header.source} does not declare")


def _layout_rows(lib: KernelLibrary, header: Header) -> dict[str, tuple[int, int]]:
    """The library's onecall_struct_layout table: name -> (sizeof, alignof) or (offsetof, sizeof)."""
    if "onecall_struct_layout" not in header.functions:
        raise RuntimeError(f"{header.source} declares structs but not onecall_struct_layout, which checks them")
    n = lib.onecall_struct_layout(None, None, 0)
    names, values = (ctypes.c_char_p * n)(), (ctypes.c_int64 * (2 * n))()
    lib.onecall_struct_layout(names, values, n)
    return {(names[i] or b"").decode(): (values[2 * i], values[2 * i + 1]) for i in range(n)}


def _row(rows: dict[str, tuple[int, int]], name: str, header: Header) -> tuple[int, int]:
    if name not in rows:
        raise RuntimeError(
            f"{name}: declared in {header.source}, but onecall_struct_layout (csrc/layout.c) has no row for it"
        )
    return rows.pop(name)
