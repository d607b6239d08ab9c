"""The primitive operations synth tasks are composed of: an English phrase and one line of code each.

Every phrase maps to exactly one code line (`x = <code>`), so a task with three steps is three
phrases and three lines: the compositional structure a tiny model can pick up from
demonstrations and then apply to combinations it has never seen (the held-out split).
Values flow through three types: `int`, `str` (lowercase letters) and `list` (of ints).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

LETTERS = "abcde"
"""Strings are drawn from a small alphabet so that count/replace/remove steps have something to do."""


@dataclass(frozen=True)
class Op:
    name: str
    """Unique name; held-out splits are defined over sequences of these names."""
    src: str
    """Type the step consumes: int, str or list."""
    dst: str
    """Type the step produces."""
    phrase: str
    """Instruction text; `{k}`, `{c}`, `{a}`, `{b}` are filled from `params`."""
    code: str
    """Right-hand side of `x = ...`, with the same placeholders."""
    params: dict[str, tuple] = field(default_factory=dict)
    """Choices for each placeholder."""

    def sample(self, rng: random.Random) -> dict[str, object]:
        values = {key: rng.choice(choices) for key, choices in self.params.items()}
        if "a" in values and values["a"] == values.get("b"):  # replace 'a' with 'a' is a no-op
            values["b"] = LETTERS[(LETTERS.index(values["a"]) + 1) % len(LETTERS)]
        return values


K_SMALL = tuple(range(2, 6))
K_ADD = tuple(range(1, 10))
CHARS = tuple(LETTERS)

OPS: list[Op] = [
    # int -> int
    Op("add", "int", "int", "add {k}", "x + {k}", {"k": K_ADD}),
    Op("sub", "int", "int", "subtract {k}", "x - {k}", {"k": K_ADD}),
    Op("mul", "int", "int", "multiply by {k}", "x * {k}", {"k": K_SMALL}),
    Op("floordiv", "int", "int", "divide by {k} rounding down", "x // {k}", {"k": K_SMALL}),
    Op("mod", "int", "int", "take the remainder mod {k}", "x % {k}", {"k": K_SMALL}),
    Op("neg", "int", "int", "negate it", "-x"),
    Op("abs", "int", "int", "take the absolute value", "abs(x)"),
    Op("square", "int", "int", "square it", "x * x"),
    Op("max", "int", "int", "take the larger of it and {k}", "max(x, {k})", {"k": K_ADD}),
    Op("min", "int", "int", "take the smaller of it and {k}", "min(x, {k})", {"k": K_ADD}),
    # int -> str / list
    Op("str", "int", "str", "convert it to a string", "str(x)"),
    Op("digits", "int", "list", "make the list of its digits", "[int(c) for c in str(abs(x))]"),
    # str -> str
    Op("reverse_str", "str", "str", "reverse it", "x[::-1]"),
    Op("upper", "str", "str", "make it uppercase", "x.upper()"),
    Op("repeat", "str", "str", "repeat it {k} times", "x * {k}", {"k": (2, 3)}),
    Op("append", "str", "str", "append '{c}'", "x + '{c}'", {"c": CHARS}),
    Op("prepend", "str", "str", "prepend '{c}'", "'{c}' + x", {"c": CHARS}),
    Op("head_str", "str", "str", "keep the first {k} characters", "x[:{k}]", {"k": K_SMALL}),
    Op("drop_str", "str", "str", "drop the first {k} characters", "x[{k}:]", {"k": K_SMALL}),
    Op("replace", "str", "str", "replace '{a}' with '{b}'", "x.replace('{a}', '{b}')", {"a": CHARS, "b": CHARS}),
    Op("remove", "str", "str", "remove every '{c}'", "x.replace('{c}', '')", {"c": CHARS}),
    Op("sort_str", "str", "str", "sort its characters", "''.join(sorted(x))"),
    # str -> int / list
    Op("len_str", "str", "int", "take its length", "len(x)"),
    Op("count_str", "str", "int", "count the '{c}' characters", "x.count('{c}')", {"c": CHARS}),
    Op("ords", "str", "list", "make the list of its character codes", "[ord(c) for c in x]"),
    # list -> list
    Op("add_each", "list", "list", "add {k} to each element", "[v + {k} for v in x]", {"k": K_ADD}),
    Op("mul_each", "list", "list", "multiply each element by {k}", "[v * {k} for v in x]", {"k": K_SMALL}),
    Op("square_each", "list", "list", "square each element", "[v * v for v in x]"),
    Op("keep_gt", "list", "list", "keep the elements greater than {k}", "[v for v in x if v > {k}]", {"k": K_ADD}),
    Op("keep_lt", "list", "list", "keep the elements less than {k}", "[v for v in x if v < {k}]", {"k": K_ADD}),
    Op("keep_even", "list", "list", "keep the even elements", "[v for v in x if v % 2 == 0]"),
    Op("keep_odd", "list", "list", "keep the odd elements", "[v for v in x if v % 2 == 1]"),
    Op("sort", "list", "list", "sort it", "sorted(x)"),
    Op("sort_desc", "list", "list", "sort it in descending order", "sorted(x, reverse=True)"),
    Op("reverse_list", "list", "list", "reverse it", "x[::-1]"),
    Op("head", "list", "list", "keep the first {k} elements", "x[:{k}]", {"k": K_SMALL}),
    Op("dedup", "list", "list", "remove repeated elements", "list(dict.fromkeys(x))"),
    # list -> int / str
    Op("sum", "list", "int", "take the sum", "sum(x)"),
    Op("len", "list", "int", "count the elements", "len(x)"),
    Op("max_list", "list", "int", "take the largest element", "max(x)"),
    Op("min_list", "list", "int", "take the smallest element", "min(x)"),
    Op("count", "list", "int", "count the elements equal to {k}", "x.count({k})", {"k": K_ADD}),
    Op("join", "list", "str", "join the elements with '{c}'", "'{c}'.join(str(v) for v in x)", {"c": ("-", ",", ":")}),
]
OPS_BY_TYPE: dict[str, list[Op]] = {}
for _op in OPS:
    OPS_BY_TYPE.setdefault(_op.src, []).append(_op)

TYPE_NAMES = {"int": "an int", "str": "a string", "list": "a list of ints"}


def random_input(kind: str, rng: random.Random) -> object:
    """A small input of the given type; small so that tests and outputs stay a few tokens long."""
    if kind == "int":
        return rng.randint(-20, 40)
    if kind == "str":
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7)))
    return [rng.randint(-5, 9) for _ in range(rng.randint(3, 6))]
