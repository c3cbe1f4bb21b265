"""JSON Schemas drawn by hypothesis for the structured-output tests: nested objects, arrays,
enums, bounded numbers, required and optional properties, anyOf. Strings and arrays are bounded
so that any answer the schema allows fits in a few dozen tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnop_", min_size=1, max_size=8)


def _integer(lo: int, span: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": lo + span}


def _number(lo: int, span: int, step: float) -> dict:
    # with multipleOf a number has finitely many spellings; without it, llguidance allows endless
    # (binary fractions only: jsonschema checks multipleOf in floating point, where 12.1 % 0.1 != 0)
    # fraction digits, and a small model at low temperature can loop on them ("10.0000...")
    return {"type": "number", "minimum": lo, "maximum": lo + span, "multipleOf": step}


LEAVES = st.one_of(
    st.builds(_integer, st.integers(-100, 100), st.integers(0, 1000)),
    st.builds(_number, st.integers(-10, 10), st.integers(1, 100), st.sampled_from([0.5, 0.25])),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(alphabet="abcdefghij ", min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict) -> st.SearchStrategy:
        return st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {"type": "object", "properties": props, "required": sorted(required), "additionalProperties": False}
        )

    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(build)


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        _object(children),
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, children, st.integers(0, 3)),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    )


def schemas() -> st.SearchStrategy[dict]:
    """A top-level object schema (what response_format json_schema is used for)."""
    return _object(st.recursive(LEAVES, _extend, max_leaves=6))


def drawn_schemas(count: int) -> list[dict]:
    """`count` schemas from hypothesis, the same every run (derandomized)."""
    drawn: list[dict] = []

    @settings(max_examples=count, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schemas())
    def draw(schema: dict) -> None:
        drawn.append(schema)

    draw()
    return drawn
