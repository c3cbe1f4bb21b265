"""The sandbox chat templates render in (torch-free): jinja2's immutable sandbox (no Python
internals, no mutation of lists or dicts), with a budget per render, since a template may come
from a tenant (an adapter's, a request's) and is code: a time limit checked at every call,
attribute or item access, operator and filter; every value a step makes at most `max_chars`
long, the steps that multiply sizes (`*`, `**`, `replace`, `join`, `indent`, padding widths)
checked before they run; and the output at most `max_chars` (chat_template.py stops reading it
there). A value's size counts what it holds, through nested lists and dicts (`[r] * 1000` holds 1000
times `r`), so no value made by reference can be stringified, compared or joined past the budget; every
loop checks the time at each step; list, tuple and dict literals and `~` concatenations are sized as they
are made (the template's syntax tree is rewritten to call the environment there, which no template name
can shadow), and a filter reading another's lazy output stops once that output passes the budget."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, nodes
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

MAX_EXPONENT = 4096
# a %-format or str.format field asking for a width or precision of millions of characters
_WIDE_FORMAT = re.compile(r"%[-+ #0]*(\d{7,}|\d*\.\d{7,})|\{[^{}]*:[^{}]*?\d{7,}")
LIPSUM_CHARS_PER_PARAGRAPH = 100 * 16  # lipsum's longest paragraph: `max` words (100), each at most ~15 letters and a space


class RenderLimitError(SecurityError):
    """A render went past its budget (a jinja2 TemplateError, so it fails as any template error)."""


@dataclass(frozen=True)
class Budget:
    deadline_s: float  # on time.monotonic's clock
    time_limit_s: float
    max_chars: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline_s:
            raise RenderLimitError(f"the chat template ran past its time limit of {self.time_limit_s:g} s")

    def check_size(self, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise RenderLimitError(f"the chat template made a value of {num_chars} characters, over its limit of "
                                   f"{self.max_chars}")

    def check_output(self, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise RenderLimitError(f"the chat template's output is over its limit of {self.max_chars} characters")

    def checked(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)):
            self.check_size(size_of(value, self.max_chars))
        return value


def size_of(value: Any, limit: int) -> int:
    """How much `value` holds: a string's length, a container's items and what each holds, a reference
    counted each time it is held; the walk stops past `limit` (so it costs at most `limit` steps)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += len(item)
            stack.extend(item)
        else:
            total += 1
    return total


_budget: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)
_UNBOUNDED = Budget(float("inf"), float("inf"), 1 << 62)


def current() -> Budget:
    return _budget.get() or _UNBOUNDED


@contextmanager
def budget(time_limit_s: float, max_chars: int) -> Iterator[Budget]:
    """The budget of the render run inside (this thread's, or this task's)."""
    bounds = Budget(time.monotonic() + time_limit_s, time_limit_s, max_chars)
    token = _budget.set(bounds)
    try:
        yield bounds
    finally:
        _budget.reset(token)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 1


def _expected_size(name: str, subject: Any, args: tuple, kwargs: dict) -> int:
    """What a call of `name` on `subject` could make, in characters, before it runs."""
    mapped = [v for a in args if isinstance(a, dict) for v in a.values()]  # format_map's: a width may be one
    ints = [a for a in (*args, *kwargs.values(), *mapped) if isinstance(a, int) and not isinstance(a, bool)]
    widest = max((abs(i) for i in ints), default=0)
    if name == "replace" and isinstance(subject, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        return len(subject) + (subject.count(args[0]) + 1 if args[0] else len(subject) + 1) * len(args[1])
    if name == "join" and isinstance(subject, str) and args:  # str.join: the separator between every item
        return len(subject) * _length(args[0])
    if name == "join" and args and isinstance(args[0], str):  # the join filter: join(items, separator)
        return len(args[0]) * _length(subject)
    if name in ("format", "format_map", "do_format") and isinstance(subject, str) and _WIDE_FORMAT.search(subject):
        raise RenderLimitError("the chat template formats a field millions of characters wide")
    if name == "generate_lorem_ipsum":
        return (args[0] if args else kwargs.get("n", 5)) * LIPSUM_CHARS_PER_PARAGRAPH
    if name == "indent" and isinstance(subject, str):
        return len(subject) + (subject.count("\n") + 1) * max(widest, len(next((a for a in args if isinstance(a, str)), "")))
    return widest


def _metered(items: Iterator[Any], bounds: Budget) -> Iterator[Any]:
    """`items`, stopped once what they hold together passes the budget (each may be within it, not all)."""
    total = 0
    for item in items:
        total += size_of(item, bounds.max_chars - total)
        bounds.check_size(total)
        yield item


def _concat(parts: list[Any]) -> str:
    """`a ~ b ~ ...`, sized before it is made (one concatenation may have thousands of parts)."""
    bounds, total = current(), 0
    for part in parts:
        total += size_of(part, bounds.max_chars - total)
        bounds.check_size(total)
    return "".join(str(part) for part in parts)


def _filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A filter run within the budget (its `pass_*` marker kept, so jinja still passes what it asks)."""

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        bounds = current()
        bounds.check_time()
        first = next((i for i, a in enumerate(args) if not isinstance(a, (Context, EvalContext, Environment))), None)
        if first is not None:  # past what jinja passes first: the filtered value, then the filter's arguments
            bounds.check_size(_expected_size(name, args[first], args[first + 1:], kwargs))
            if isinstance(args[first], Iterator):  # another filter's lazy output (map, select): sized as it is read
                args = (*args[:first], _metered(args[first], bounds), *args[first + 1:])
        return bounds.checked(func(*args, **kwargs))

    return bounded


class BoundedNamespace(Namespace):
    """`namespace()`, whose attributes hold values within the budget (a loop cannot double one forever)."""

    def __setitem__(self, name: str, value: Any) -> None:
        current().checked(value)
        super().__setitem__(name, value)


def _guarded_iter(iterable: Any) -> Iterator[Any]:
    """A loop's items, the time checked before each (a loop over a list made once calls nothing)."""
    bounds = current()
    for item in iterable:
        bounds.check_time()
        yield item


def _sized_literal(value: Any) -> Any:
    """A list, tuple or dict literal, sized as it is made (`[r, r]` holds r twice)."""
    return current().checked(value)


class _Guarded(NodeTransformer):
    """Every loop's iterable through `environment.guarded_iter`, every literal with variables in it through
    `environment.sized_literal` (environment attributes: a template's names cannot shadow them)."""

    def _wrapped(self, attribute: str, node: nodes.Expr) -> nodes.Expr:
        return nodes.Call(nodes.EnvironmentAttribute(attribute), [node], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._wrapped("guarded_iter", node.iter)
        return node

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        return node if getattr(node, "ctx", "load") != "load" else self._wrapped("sized_literal", node)

    visit_List = visit_Tuple = visit_Dict = _literal

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._wrapped("sized_concat", nodes.List(node.nodes, lineno=node.lineno))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    guarded_iter = staticmethod(_guarded_iter)
    sized_literal = staticmethod(_sized_literal)
    sized_concat = staticmethod(_concat)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _filter(name, f) for name, f in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace
        self.finalize = self._finalized

    def _finalized(self, value: Any) -> Any:
        """What `{{ }}` writes, sized before it is made a string."""
        return current().checked(value)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guarded().visit(super()._parse(source, name, filename))

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        self.filters[name] = _filter(name, func)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        bounds = current()
        bounds.check_time()
        if operator == "*":
            count = right if isinstance(left, (str, list, tuple)) else left
            if isinstance(count, int):
                repeated = left if count is right else right
                bounds.check_size(size_of(repeated, bounds.max_chars) * count if repeated else 0)
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise RenderLimitError(f"the chat template raised a number to the power {right}, over {MAX_EXPONENT}")
        elif operator == "%" and isinstance(left, str):
            if _WIDE_FORMAT.search(left):
                raise RenderLimitError("the chat template formats a field millions of characters wide")
            if "*" in left:  # `%*d`: a width is an argument
                widths = right if isinstance(right, tuple) else (right,)
                bounds.check_size(max((abs(w) for w in widths if isinstance(w, int)), default=0))
        return bounds.checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        bounds = current()
        bounds.check_time()
        for value in (*args, *kwargs.values()):  # a recursive macro may double its argument each call
            bounds.checked(value)
        name = getattr(__obj, "__name__", "")
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format: its string is the wrapped one's
        bounds.check_size(_expected_size(name, getattr(method, "__self__", None), args, kwargs))
        return bounds.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        current().check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current().check_time()
        return super().getitem(obj, argument)
