"""The sandbox chat templates render in (torch-free): jinja2's immutable sandbox (no Python
internals, no mutation of lists or dicts), with a budget per render, since a template may come
from a tenant (an adapter's, a request's) and is code: a time limit checked at every call,
attribute or item access, operator and filter; every value a step makes at most `max_chars`
long, the steps that multiply sizes (`*`, `**`, `replace`, `join`, `indent`, padding widths)
checked before they run; and the output at most `max_chars` (chat_template.py stops reading it
there)."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_EXPONENT = 4096
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{7,}")  # a %-format asking for a field of millions of characters


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
            self.check_size(len(value))
        return value


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
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    widest = max((abs(i) for i in ints), default=0)
    if name == "replace" and isinstance(subject, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        return len(subject) + (subject.count(args[0]) + 1 if args[0] else len(subject) + 1) * len(args[1])
    if name == "join" and isinstance(subject, str) and args:  # str.join: the separator between every item
        return len(subject) * _length(args[0])
    if name == "join" and args and isinstance(args[0], str):  # the join filter: join(items, separator)
        return len(args[0]) * _length(subject)
    if name == "indent" and isinstance(subject, str):
        return len(subject) + (subject.count("\n") + 1) * max(widest, len(next((a for a in args if isinstance(a, str)), "")))
    return widest


def _filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A filter run within the budget (its `pass_*` marker kept, so jinja still passes what it asks)."""

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        bounds = current()
        bounds.check_time()
        values = [a for a in args if not isinstance(a, (Context, EvalContext, Environment))]  # past what jinja passes first
        if values:
            bounds.check_size(_expected_size(name, values[0], tuple(values[1:]), kwargs))
        return bounds.checked(func(*args, **kwargs))

    return bounded


class BoundedNamespace(Namespace):
    """`namespace()`, whose attributes hold values within the budget (a loop cannot double one forever)."""

    def __setitem__(self, name: str, value: Any) -> None:
        current().checked(value)
        super().__setitem__(name, value)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _filter(name, f) for name, f in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        self.filters[name] = _filter(name, func)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        bounds = current()
        bounds.check_time()
        if operator == "*":
            count = right if isinstance(left, (str, list, tuple)) else left
            if isinstance(count, int):
                bounds.check_size(_length(left if count is right else right) * count)
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise RenderLimitError(f"the chat template raised a number to the power {right}, over {MAX_EXPONENT}")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise RenderLimitError("the chat template formats a field millions of characters wide")
        return bounds.checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        bounds = current()
        bounds.check_time()
        for value in (*args, *kwargs.values()):  # a recursive macro may double its argument each call
            bounds.checked(value)
        name = getattr(__obj, "__name__", "")
        bounds.check_size(_expected_size(name, getattr(__obj, "__self__", None), args, kwargs))
        return bounds.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        current().check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current().check_time()
        return super().getitem(obj, argument)
