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
