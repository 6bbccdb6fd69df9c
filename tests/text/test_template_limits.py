"""Hostile chat templates end in a TemplateError naming the limit they hit, quickly and before the
memory is spent; ordinary Jinja renders exactly as jinja2's own sandbox renders it.

The limits here are small (0.3 s, 100,000 characters) so each hostile render ends fast; one test per
limit runs with the defaults (text/template_sandbox.py's RenderLimits). Each hostile template is timed:
a check that came only after building a gigabyte string would still pass on the message, not the time.
"""

from __future__ import annotations

import time
from typing import Any

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from onecall.errors import InvalidParameterError, TemplateError
from onecall.text.chat_template import ChatTemplate
from onecall.text.template_limits import RenderLimits

SMALL = RenderLimits(max_seconds=0.3, max_chars=100_000)
TIME, SIZE, OUTPUT = (
    r"time limit \(0\.3 s\)",
    "over the limit of 100000",
    "output grew past the limit of 100000",
)
MESSAGES = [{"role": "user", "content": "hi"}]


def _render(source: str, limits: RenderLimits = SMALL, **variables: Any) -> str:
    return ChatTemplate(source, limits=limits).render(MESSAGES, **variables)


def _doubled(statement: str, times: int) -> str:
    return statement * times


HOSTILE = [
    # time: loops and recursion that never build anything large
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", TIME),
    ("{% set r = range(40000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", TIME),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", TIME),
    ("{{ (range(50000)|map('string')|map('list')|sum(start=[]))|length }}", TIME + "|" + SIZE),
    # size: one operation asked for a huge value
    ("{{ 'a' * 10**9 }}", SIZE),
    ("{{ ['a'] * 10**9 }}", SIZE),
    ("{{ 10 ** (10 ** 8) }}", "over 65536 bits"),
    ("{{ 'a'|center(1000000000) }}", SIZE),
    ("{{ 'a'.ljust(1000000000) }}", SIZE),
    ("{{ '%1000000000d' % 1 }}", SIZE),
    ("{{ '%*d' % (1000000000, 1) }}", SIZE),
    ("{{ '%1000000000d'|format(1) }}", SIZE),
    ("{{ '{:>1000000000}'.format(1) }}", SIZE),
    ("{{ '{:{}}'.format(1, 1000000000) }}", SIZE),
    ("{{ 'a\na'|indent(1000000000) }}", SIZE),
    ("{{ big.replace('', big) }}", SIZE),
    ("{{ big|replace('', big) }}", SIZE),
    ("{{ big.join(range(100000)|map('string')) }}", SIZE),
    ("{{ range(100000)|join(big) }}", SIZE),
    ("{{ (1).to_bytes(1000000000, 'big') }}", SIZE),
    ("{{ lipsum(n=100000) }}", SIZE),
    ("{{ range(10)|slice(1000000000)|list }}", SIZE),
    ("{{ [1]|batch(1000000000, 0)|list }}", SIZE),
    ("{% set a = [[[['x'] * 100] * 100] * 5] %}{{ a|tojson(indent=100000) }}", SIZE),
    # size: a value doubled until it is huge, by every way of keeping it
    (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        SIZE,
    ),
    ("{% set s = 'ab' %}" + _doubled("{% set s = s + s %}", 64), SIZE),
    ("{% set s = 'ab' %}" + _doubled("{% set s = s ~ s %}", 64), SIZE),
    ("{% set l = ['ab'] %}" + _doubled("{% set l = l + l %}", 64), SIZE),
    ("{% set a = ['x'] %}" + _doubled("{% set a = [a, a] %}", 64) + "{{ a }}", SIZE + "|" + TIME),
    (
        "{% set d = {'k': 'x'} %}" + _doubled("{% set d = {'k': d, 'j': d} %}", 64) + "{{ d }}",
        SIZE + "|" + TIME,
    ),
    ("{% macro f(s, n) %}{% if n %}{{ f(s + s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 64) }}", SIZE),
    # output: small values, written many times (static text in a buffered loop too)
    ("{% for i in range(100000) %}{{ big }}{% endfor %}", OUTPUT),
    ("{% for i in range(100000) %}" + "x" * 100 + "{% endfor %}", OUTPUT),
    (
        "{% macro m() %}{% for i in range(100000) %}"
        + "x" * 100
        + "{% endfor %}{% endmacro %}{% set x = m() %}",
        OUTPUT,
    ),
    # recursion: Python's own limit, named
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests too deeply"),
]


@pytest.mark.parametrize(("source", "match"), HOSTILE)
def test_hostile_templates_hit_a_named_limit(source: str, match: str) -> None:
    start = time.perf_counter()
    with pytest.raises(TemplateError, match=match):
        _render(source, big="b" * 50_000)
    assert time.perf_counter() - start < SMALL.max_seconds + 1.0


@pytest.mark.slow
def test_default_limits() -> None:
    start = time.perf_counter()
    with pytest.raises(TemplateError, match=r"time limit \(1 s\)"):
        _render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", RenderLimits()
        )
    assert time.perf_counter() - start < 3.0
    with pytest.raises(TemplateError, match="over the limit of 16777216"):
        _render("{{ 'a' * 10**9 }}", RenderLimits())


def test_nothing_runs_at_compile_time() -> None:
    # jinja2 folds constant expressions while compiling: a filter on constants would run inside
    # from_string, before any limit applies; onecall's sandbox folds nothing
    start = time.perf_counter()
    template = ChatTemplate("{{ 'a'|center(100000000) }}{{ range(100000)|join('x' * 1000) }}", limits=SMALL)
    assert time.perf_counter() - start < 0.5
    with pytest.raises(TemplateError, match=SIZE):
        template.render(MESSAGES)


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidParameterError, match="max_seconds"):
        RenderLimits(max_seconds=0)
    with pytest.raises(InvalidParameterError, match="max_chars"):
        RenderLimits(max_chars=-1)


# ---------------------------------------------------------------- ordinary templates render as before

ORDINARY = [
    "{% for x in items %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for x in items|reverse %}{{ loop.revindex }}{{ x }}{% else %}none{% endfor %}",
    "{% for x in [] %}{{ x }}{% else %}none{% endfor %}",
    "{% for x in items if x > 1 %}{{ x }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% for k, v in pairs %}{{ k }}={{ v }};{% endfor %}",
    "{% set a, b = 1, 2 %}{{ a + b }}{% set t = (1, 2) %}{{ t }}",
    "{% for x in nested recursive %}[{{ x.name }}{% if x.kids %}{{ loop(x.kids) }}{% endif %}]{% endfor %}",
    "{% macro m(x, y=[], z={'k': 1}) %}{{ x }}{{ y|length }}{{ z.k }}{% endmacro %}{{ m('a') }}{{ m('b', [1, 2]) }}",
    "{% set ns = namespace(n=0) %}{% for x in items %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}",
    "{% set s %}{% for x in items %}<{{ x }}>{% endfor %}{% endset %}{{ s ~ '|' ~ s|length }}",
    "{{ 'x' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ '%05d|%s' % (42, 'y') }}{{ '{:>4}'.format(7) }}{{ 7 % 3 }}",
    "{{ 'a\nb'|indent(2, true) }}{{ items|join(', ') }}{{ 'ab'|center(6) }}{{ 'a-b'|replace('-', '+') }}",
    "{{ items|map('string')|join }}{{ items|sum }}{{ [[1], [2]]|sum(start=[]) }}{{ items|batch(2)|list }}",
    "{{ pairs|tojson }}{{ pairs|tojson(indent=2) }}{{ 'é'.center(5, '*') }}{{ 'a\tb'.expandtabs(4) }}",
    "{% filter upper %}{% for x in items %}{{ x }}{% endfor %}{% endfilter %}{{ {'a': [1, (2, 3)]} }}",
]


@pytest.mark.parametrize("source", ORDINARY)
def test_ordinary_templates_render_as_in_jinja2(source: str) -> None:
    variables = {
        "items": [1, 2, 3],
        "pairs": [["a", 1], ["b", 2]],
        "nested": [{"name": "a", "kids": [{"name": "b", "kids": []}]}, {"name": "c", "kids": []}],
    }
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    expected = plain.from_string(source).render(messages=MESSAGES, **variables)
    assert _render(source, RenderLimits(), **variables) == expected


def test_a_limit_error_is_a_template_error_not_a_jinja_one() -> None:
    with pytest.raises(TemplateError) as info:
        _render("{{ 'a' * 10**9 }}")
    assert not isinstance(info.value.__cause__, jinja2.TemplateError)
