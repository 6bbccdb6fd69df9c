"""What one chat-template render may spend: time and size (RenderLimits), checked wherever a template
can spend them, so a hostile template ends in a TemplateError naming the limit instead of hanging or
exhausting memory.

jinja2's sandbox keeps a template away from Python's internals and caps range() at 100,000 items, but a
template can still nest loops, recurse through macros and double a string until memory runs out.
BoundedSandbox checks the render's budget at every place a template can spend time or grow a value:

| where                                          | checked                                               |
|------------------------------------------------|-------------------------------------------------------|
| each loop iteration (every `for` is wrapped)   | the deadline; the static text of the loop's body      |
| each call (macro, method, global), each filter | the deadline; width-like arguments (center, ljust,    |
|                                                | indent, replace, join, format, ...) before; the result|
| operators + * ** %                             | the result's size, before computing it for * ** %     |
|                                                | (a chain a + b + c is one check)                      |
| `~` operands; list, tuple and dict literals    | their size                                            |
| each `{{ ... }}`                               | the total output                                      |

A size is a string's length, or for a list, tuple or dict its items plus the sizes of what it holds,
shared or not, so no value can exist that would print over the limit. Nothing from a template runs at
compile time: the optimizer is off and `finalize` takes the context, so jinja2 folds no constant (it
would otherwise compute `'a'|center(10**10)` inside from_string). The common case (a short string
joined, a call, a piece of output) costs a few comparisons.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from onecall.errors import InvalidParameterError


@dataclass(frozen=True)
class RenderLimits:
    """How long one render may take and how large what it builds may grow. The defaults are far above
    what a real template needs (milliseconds; the prompt itself, which the server caps at 4 MiB)."""

    max_seconds: float = 1.0
    max_chars: int = 16 * 2**20  # any one value, and all output together (characters or items)

    def __post_init__(self) -> None:
        if not self.max_seconds > 0:
            raise InvalidParameterError("max_seconds", f"must be positive, got {self.max_seconds!r}")
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars <= 0:
            raise InvalidParameterError("max_chars", f"must be a positive integer, got {self.max_chars!r}")


class LimitExceeded(Exception):
    """A render went over its RenderLimits (ChatTemplate.render turns it into a TemplateError). Not a
    ValueError, so no code between the template and the render catches it as a bad value."""


_MAX_INT_BITS = 2**16  # ints a template computes (Python will not even print one over ~14,000 bits)
_LOOP_GUARD, _VALUE_GUARD, _ADD = "onecall_loop_guard", "onecall_value_guard", "onecall_add"
_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # '{:{width}}': a width taken from the arguments


class _Budget:
    """One render's deadline and output count, and the size check every hook runs. The hooks run for
    every operator, call and piece of output, so the common case is kept to a few comparisons: the
    message naming what went over is only formatted when something does."""

    __slots__ = ("deadline", "max_chars", "max_seconds", "emitted")

    def __init__(self, limits: RenderLimits) -> None:
        self.max_seconds, self.max_chars = limits.max_seconds, limits.max_chars
        self.deadline = time.monotonic() + limits.max_seconds
        self.emitted = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(f"the chat template ran past its time limit ({self.max_seconds:g} s)")

    def emit(self, num_chars: int) -> None:
        self.emitted += num_chars
        if self.emitted > self.max_chars:
            raise LimitExceeded(
                f"the chat template's output grew past the limit of {self.max_chars} characters"
            )

    def need(self, size: int, what: str, subject: Any = None) -> None:
        """Refuse to build something of `size` (characters or items): `what` (of `subject`) would."""
        if size > self.max_chars:
            if subject is not None:
                what = f"{what} {getattr(subject, '__name__', subject)}"
            raise LimitExceeded(
                f"the chat template's {what} would build a value of {size} characters or items, over the "
                f"limit of {self.max_chars}"
            )

    def checked(self, value: Any, what: str, subject: Any = None) -> Any:
        """`value`, unless its size is over the limit."""
        kind = type(value)
        if kind is str:
            if len(value) > self.max_chars:
                self.need(len(value), what, subject)
        elif kind in _CONTAINERS or isinstance(value, (str, *_CONTAINERS)):
            self.need(self.size(value), what, subject)
        return value

    def size(self, value: Any) -> int:
        """A string's length; a container's items plus the sizes of what it holds, counted as often as
        it holds them. Depth first, keeping one iterator per level; stops once over the limit."""
        limit, total, visited, stack = self.max_chars, 0, 0, [iter((value,))]
        while stack:
            item = next(stack[-1], _END)
            if item is _END:
                stack.pop()
                continue
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict):
                total += 1 + len(item)
                stack.append(itertools.chain(item.keys(), item.values()))
            elif isinstance(item, _CONTAINERS):
                total += 1 + len(item)
                stack.append(iter(item))
            else:
                total += 1
            if total > limit:
                return total
            visited += 1
            if not visited & 0xFFFF:  # a value shared many times over is a long walk
                self.tick()
        return total


_END = object()
_CONTAINERS = (list, tuple, dict, set, frozenset)
_BUDGET: ContextVar[_Budget | None] = ContextVar("onecall_template_budget", default=None)
_UNBOUNDED = RenderLimits(max_seconds=math.inf)


def _budget() -> _Budget:
    """The running render's budget; outside a render (nothing of a template should run there) a fresh
    one with no deadline, so the stateless size checks still apply."""
    return _BUDGET.get() or _Budget(_UNBOUNDED)


def render_bounded(template: jinja2.Template, limits: RenderLimits, context: dict[str, Any]) -> str:
    """template.render(context) within `limits`: over them, LimitExceeded."""
    token = _BUDGET.set(_Budget(limits))
    try:
        return template.render(context)
    finally:
        _BUDGET.reset(token)


# ---------------------------------------------------------------- sizes of operations, before they run


def _format_size(fmt: str, args: Any) -> int:
    """An upper estimate of `fmt % args` or `fmt.format(*args)`: the format, its arguments, and every
    number written in it taken as a width (and the integer arguments too, where a width can come from
    one: `%*d`, `{:{}}`)."""
    values = list(args.values()) if isinstance(args, dict) else list(args)
    budget = _budget()
    size = len(fmt) + sum(budget.size(v) if isinstance(v, (str, *_CONTAINERS)) else 24 for v in values)
    size += sum(int(run) if len(run) <= 9 else 10**9 for run in _DIGITS.findall(fmt))
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        size += sum(abs(v) for v in values if isinstance(v, int))
    return size


def _int(value: Any) -> int:
    """An int argument's value, 0 for anything else (Python will reject it on its own)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old)
    n = min(n, count) if _int(count) > 0 else n
    return len(s) + n * (len(new) - len(old))


_GROWING_METHODS = frozenset(
    {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate"}
)


def _method_size(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What a string method a template calls would build, for the methods that can grow a string."""
    s, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill"):
        return _int(_arg(args, kwargs, 0, "width"))
    if name == "expandtabs":
        return len(s) * max(1, _int(_arg(args, kwargs, 0, "tabsize", 8)))
    if name == "replace":
        return _replace_size(
            s, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count")
        )
    if name == "join" and args and hasattr(args[0], "__len__"):
        return len(s) * len(args[0])
    if name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return len(s) * longest
    return 0


def _indent_size(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    text, width = str(_arg(a, k, 0, "s", "")), _arg(a, k, 1, "width", 4)
    return len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else _int(width))


def _join_size(a: tuple[Any, ...], k: dict[str, Any]) -> int:
    items = _arg(a, k, 0, "value", ())
    return len(str(_arg(a, k, 1, "d", ""))) * (len(items) if hasattr(items, "__len__") else 1)


# filter name -> what it would build, from its arguments (after the context or environment, if it takes one)
_FILTER_SIZES: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], int]] = {
    "center": lambda a, k: _int(_arg(a, k, 1, "width", 80)),
    "indent": _indent_size,
    "format": lambda a, k: _format_size(str(a[0]), a[1:] or k) if a else 0,
    "replace": lambda a, k: _replace_size(
        *(_arg(a, k, i, n) for i, n in enumerate(("s", "old", "new", "count")))
    ),
    "join": _join_size,
    "slice": lambda a, k: _int(_arg(a, k, 1, "slices")),
    "batch": lambda a, k: _int(_arg(a, k, 1, "linecount")),
}


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` checking the deadline, what it would build (_FILTER_SIZES) and what it built."""
    takes_context = getattr(func, "jinja_pass_arg", None) is not None  # pass_context & co: one more argument
    size_of = _FILTER_SIZES.get(name)
    materialize = name == "join"  # a generator's items are counted before the separator is repeated

    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get() or _budget()
        if time.monotonic() > budget.deadline:
            budget.tick()
        if size_of is not None or materialize:
            head, rest = args[: int(takes_context)], args[int(takes_context) :]
            if materialize and rest and not hasattr(rest[0], "__len__"):
                rest = (_take(rest[0], budget), *rest[1:])
                args = (*head, *rest)
            if size_of is not None:
                budget.need(size_of(rest, kwargs), "filter", name)
        return budget.checked(func(*args, **kwargs), "filter", name)

    guarded.__dict__.update(getattr(func, "__dict__", {}))  # jinja_pass_arg: the context passed as before
    return guarded


def _take(items: Any, budget: _Budget) -> list[Any]:
    """An iterable's items as a list, checking the deadline as they come (a generator from map, select)."""
    out = []
    for item in items:
        out.append(item)
        if len(out) % 4096 == 0:
            budget.tick()
            budget.need(len(out), "iteration")
    return out


@jinja2.pass_environment
def _guarded_sum(
    environment: jinja2.Environment, iterable: Any, attribute: Any = None, start: Any = 0
) -> Any:
    """jinja2's `sum`, one addition at a time: summing lists (start=[]) is quadratic, so each step is
    checked like the + operator."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    budget, total = _budget(), start
    for item in iterable:
        budget.tick()
        total = budget.checked(total + item, "filter", "sum")
    return total


def _loop_guard(items: Any, static_chars: int) -> Iterator[Any]:
    """A loop's items, checking the deadline at each and counting the static text of the loop's body
    (written out without passing finalize) as output. (jinja2's `loop.length` reads such an iterator
    to its end, checking as it goes.)"""
    budget = _BUDGET.get() or _budget()
    for item in items:
        if time.monotonic() > budget.deadline:
            budget.tick()
        if static_chars:
            budget.emit(static_chars)
        yield item


def _add(first: Any, *rest: Any) -> Any:
    """`first + rest[0] + ...` (jinja2's +, left to right), its result checked: the common case, a few
    short strings joined, costs one call for the whole chain."""
    result = first
    for operand in rest:
        result = result + operand
    budget = _BUDGET.get() or _budget()
    if type(result) is str and len(result) < 4096 and len(result) <= budget.max_chars:
        return result
    budget.tick()
    return budget.checked(result, "operator", "+")


def _value_guard(value: Any) -> Any:
    return _budget().checked(value, "expression")


@jinja2.pass_context
def _finalize(context: jinja2.runtime.Context, value: Any) -> str:
    """Every `{{ ... }}`'s text, counted against the limit. (No deadline check: output that is not in
    a loop or a call, which check it, is bounded by the template's length and the output limit.)"""
    text = value if type(value) is str else str(value)
    budget = _BUDGET.get() or _budget()
    budget.emitted += len(text)
    if budget.emitted > budget.max_chars:
        budget.emit(0)  # raises, naming the limit
    return text


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # jinja2's argument names
    _budget().need(_int(n) * _int(max) * 12, "call of", "lipsum")  # words of up to ~12 characters
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def bounded_text(chunks: Iterable[str], what: str) -> str:
    """The chunks joined, their size and the deadline checked as they come (json's indented encoder)."""
    budget, out, size = _budget(), [], 0
    for chunk in chunks:
        out.append(chunk)
        size += len(chunk)
        if size > budget.max_chars:
            budget.need(size, what)
        if not len(out) & 0xFFF:
            budget.tick()
    return "".join(out)


# ---------------------------------------------------------------- the environment


class _Guards(NodeTransformer):
    """Rewrites a parsed template so the budget is checked where the table in the module docstring says."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        # the static text one iteration writes at most (nested loops' included: counted once more)
        static_chars = sum(len(data.data) for data in node.find_all(nodes.TemplateData))
        self.generic_visit(node)
        guard_args: list[nodes.Expr] = [nodes.Const(static_chars)]
        node.iter = nodes.Filter(node.iter, _LOOP_GUARD, guard_args, [], None, None, lineno=node.lineno)
        return node

    def visit_Add(self, node: nodes.Add) -> nodes.Node:
        operands: list[nodes.Expr] = [node.right]  # a + b + c parses as (a + b) + c: one call for the chain
        while isinstance(node.left, nodes.Add):
            node = node.left
            operands.append(node.right)
        operands.append(node.left)
        first, *rest = [self.visit(operand) for operand in reversed(operands)]
        return nodes.Filter(first, _ADD, rest, [], None, None, lineno=node.lineno)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_checked(n) for n in node.nodes]
        return node

    def visit_List(self, node: nodes.List) -> nodes.Node:
        return _checked(self.generic_visit(node))

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        return _checked(self.generic_visit(node))

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        self.generic_visit(node)
        return _checked(node) if node.ctx == "load" else node  # not an assignment's target


def _checked(node: nodes.Node) -> nodes.Expr:
    return nodes.Filter(node, _VALUE_GUARD, [], [], None, None, lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every template's spending checked (the module docstring's
    table). `filters` and `globals` are added to jinja2's own; every filter is checked."""

    intercepted_binops = frozenset({"*", "**", "%"})  # + is rewritten as a call of _add (_Guards)

    def __init__(
        self, *, filters: dict[str, Callable[..., Any]], globals: dict[str, Any], **options: Any
    ) -> None:
        super().__init__(optimized=False, finalize=_finalize, **options)  # optimized: nothing folded
        all_filters = self.filters | filters | {"sum": _guarded_sum}
        self.filters = {name: _guarded_filter(name, f) for name, f in all_filters.items()}
        self.filters |= {_LOOP_GUARD: _loop_guard, _VALUE_GUARD: _value_guard, _ADD: _add}
        self.globals.update(globals, lipsum=_lipsum)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        return _Guards().visit(tree)  # type: ignore[no-any-return]

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get() or _budget()
        if time.monotonic() > budget.deadline:
            budget.tick()
        bound_to = getattr(__obj, "__self__", None)
        if not __self.is_safe_callable(__obj):
            raise jinja2.exceptions.SecurityError(f"{__obj!r} is not safely callable")
        if isinstance(bound_to, (str, bytes)):  # its result is no larger than the string, unless it grows
            if __obj.__name__ in _GROWING_METHODS:
                if __obj.__name__ == "join" and args and not hasattr(args[0], "__len__"):
                    args = (_take(args[0], budget), *args[1:])
                budget.need(_method_size(__obj, args, kwargs), "call of", __obj)
            return __context.call(__obj, *args, **kwargs)
        if isinstance(bound_to, int) and __obj.__name__ == "to_bytes":
            budget.need(_int(_arg(args, kwargs, 0, "length", 1)), "call of", __obj)
        return budget.checked(__context.call(__obj, *args, **kwargs), "call of", __obj)

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get() or _budget()
        budget.tick()
        if op == "*":
            _check_product(left, right, budget)
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > _MAX_INT_BITS:
                raise LimitExceeded(f"the chat template's {left} ** {right} is over {_MAX_INT_BITS} bits")
        elif op == "%" and isinstance(left, str):
            budget.need(
                _format_size(left, right if isinstance(right, (tuple, dict)) else (right,)), "operator", "%"
            )
        return budget.checked(self.binop_table[op](left, right), "operator", op)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked_format(*args: Any, **kwargs: Any) -> str:
            values = args[0] if is_map and args and isinstance(args[0], dict) else (*args, *kwargs.values())
            _budget().need(_format_size(fmt, values), "call of", value)
            return formatter(*args, **kwargs)

        return functools.update_wrapper(checked_format, formatter)


def _check_product(left: Any, right: Any, budget: _Budget) -> None:
    """`left * right`: a repeated string or list must fit, two ints stay under _MAX_INT_BITS."""
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            size = budget.size(seq)
            budget.need(size * max(times, 0), "operator", "*")
            return
    if (
        isinstance(left, int)
        and isinstance(right, int)
        and left.bit_length() + right.bit_length() > _MAX_INT_BITS
    ):
        raise LimitExceeded(f"the chat template's product of ints is over {_MAX_INT_BITS} bits")
