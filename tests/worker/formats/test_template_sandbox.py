"""The bounded sandbox chat templates render in: a template is code (a tenant's adapter's, a
request's), so a render that runs too long or makes too much fails as a template error."""

from __future__ import annotations

import pytest

from worker.formats.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("source", "message"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "output is over its limit"),
    ("{{ 'a' * 1000000000 }}", "a value of 1000000000 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("{{ ('a' * 1000)|replace('a', 'b' * 5000) }}", "a value of"),
    ("{{ 'a'.center(1000000000) }}", "a value of"),
    ("{{ range(100000)|join('x' * 1000) }}", "a value of"),
    ("{{ '%1000000000d' % 3 }}", "millions of characters wide"),
    ("{{ 2 ** 100000 }}", "power"),
    ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('a') }}", "chat template failed"),
])
def test_a_render_past_its_budget_fails(source, message) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render(MESSAGES, max_chars=1 << 20)


def test_a_render_past_its_time_fails_even_without_output() -> None:
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # hours of looping
    with pytest.raises(ChatTemplateError, match="time limit of 0.2 s"):
        ChatTemplate(spin).render(MESSAGES, time_limit_s=0.2)


def test_ordinary_templates_render_within_the_budget() -> None:
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{{ (m.content|replace('\\n', ' '))|trim }}{{ '-' * 3 }}{% endfor %}{{ ns.n }}{{ ['a', 'b']|join(',') }}")
    big = "word\n" * 20_000
    out = ChatTemplate(source).render([{"role": "user", "content": big}, *MESSAGES], max_chars=1 << 20)
    assert out.endswith("---hi---2a,b") and len(out) == len(big.replace("\n", " ").strip()) + len("---hi---2a,b")


# hostile templates whose work is not a call: loops over a list made once, containers nested by reference,
# filters jinja folds at compile time, lipsum and %-/str.format field widths
@pytest.mark.parametrize("source", [
    "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}{% endfor %}{% endfor %}",
])
def test_a_loop_with_no_call_in_it_stops_at_the_time_limit(source) -> None:
    with pytest.raises(ChatTemplateError, match="time limit of 0.2 s"):
        ChatTemplate(source).render(MESSAGES, time_limit_s=0.2)


@pytest.mark.parametrize("source", [
    "{% set r = range(100000)|list %}{{ [r] * 1000 }}",
    "{% set r = range(100000)|list %}{{ ([r] * 1000)|join|length }}",
    "{% set r = range(100000)|list %}{{ ([r] * 1000)|tojson|length }}",
    "{% set r = range(100000)|list %}{{ ([r] * 1000)|sum(start=[])|length }}",
    "{% set a = range(100000)|list %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}{% set d = [c, c, c, c] %}"
    "{{ d|string|length }}",
    "{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a }}",
    "{{ '%1000000000d'|format(3) }}",
    "{{ '%.1000000000f'|format(1.0) }}",
    "{{ '%.1000000000f' % 1.0 }}",
    "{{ '{:.1000000000f}'.format(1.0) }}",
    "{{ '{:{w}}'.format_map({'w': 1000000000}) }}",
    "{{ '%*d' % (1000000000, 1) }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ lipsum(100000) }}",
    "{% set a = 'x' * 1000000 %}{{ (" + " ~ ".join(["a"] * 3000) + ")|length }}",  # one concatenation, 3000 parts
    "{{ range(100000)|map('string')|map('center', 1000000)|join|length }}",  # each part allowed, the whole not
    "{{ range(100000)|map('string')|map('center', 1000000)|list|length }}",
])
def test_values_made_by_reference_or_width_are_refused_before_they_are_made(source) -> None:
    with pytest.raises(ChatTemplateError, match="limit|millions of characters wide"):
        ChatTemplate(source).render(MESSAGES, max_chars=1 << 20, time_limit_s=60.0)


@pytest.mark.parametrize("source", [
    "{% set loop_guard = none %}{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for a, b in [(1, 2), (3, 4)] %}{{ a }}{{ b }}{% endfor %}{% set x, y = 5, 6 %}{{ x }}{{ y }}",
    "{{ {'a': [1, 2]}['a'][1] }}{% for k, v in {'z': 9}.items() %}{{ k }}{{ v }}{% endfor %}",
])
def test_ordinary_loops_and_literals_still_render(source) -> None:
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) in ("hi", "12345" + "6", "2z9")
