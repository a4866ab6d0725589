"""The functions swe-lite's repositories are made of, and the bugs each one can carry.

A `Function` is correct Python source (a `def`, sometimes with the helper it calls), the argument
tuples its tests call it with (the expected values come from running the correct source), the
constants it is drawn with, and its bugs. A `Bug` replaces one snippet of the correct source with a
wrong one; its family is one of FAMILIES. `{name}` fields in source and bugs are the function's
constants (and `{name_bad}`: the constant plus one, for the wrong-constant family).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("wrong-operator", "off-by-one", "wrong-constant", "swapped-arguments", "wrong-name")


@dataclass(frozen=True)
class Bug:
    family: str
    correct: str  # a snippet of the correct source, rendered with the constants
    buggy: str  # what replaces it

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Bug: family {self.family!r} is not one of {FAMILIES}")


@dataclass(frozen=True)
class Function:
    name: str
    source: str
    cases: tuple[tuple, ...]
    bugs: tuple[Bug, ...]
    constants: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _f(name: str, source: str, cases: list[tuple], bugs: list[tuple[str, str, str]], **constants: tuple[int, ...]) -> Function:
    return Function(name, source.strip("\n") + "\n", tuple(cases), tuple(Bug(*b) for b in bugs), constants)


FUNCTIONS: tuple[Function, ...] = (
    _f("clamp", """
def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value
""", [(5, 0, 10), (-3, 0, 10), (12, 0, 10)],
       [("wrong-operator", "value < low", "value > low"), ("wrong-name", "        return high", "        return value")]),
    _f("mean", """
def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)
""", [([2, 4, 6],), ([5],), ([1, 2],)],
       [("off-by-one", "/ len(values)", "/ (len(values) - 1)"), ("wrong-operator", "total + value", "total - value"),
        ("wrong-name", "total + value", "total + total")]),
    _f("scale", """
def scale(amount):
    return amount * {factor} + {offset}
""", [(0,), (3,), (10,)],
       [("wrong-constant", "* {factor}", "* {factor_bad}"), ("wrong-constant", "+ {offset}", "+ {offset_bad}"),
        ("wrong-operator", "+ {offset}", "- {offset}")], factor=(2, 3, 5, 7), offset=(1, 4, 6, 9)),
    _f("area", """
def area(width, height):
    return width * height
""", [(3, 4), (5, 5), (0, 7)], [("wrong-operator", "width * height", "width + height")]),
    _f("span", """
def delta(start, end):
    return end - start


def span(items):
    return delta(min(items), max(items))
""", [([3, 9, 4],), ([1, 1],), ([-2, 5],)],
       [("swapped-arguments", "delta(min(items), max(items))", "delta(max(items), min(items))"),
        ("wrong-operator", "end - start", "end + start")]),
    _f("count_above", """
def count_above(values, limit):
    return sum(1 for value in values if value > limit)
""", [([1, 5, 5, 7], 5), ([9, 2], 1), ([], 3)],
       [("wrong-operator", "value > limit", "value >= limit"), ("wrong-name", "value > limit", "limit > value")]),
    _f("last_n", """
def last_n(items, n):
    return items[len(items) - n:]
""", [([1, 2, 3, 4], 2), ([7, 8], 1), ([5, 6, 7], 3)],
       [("off-by-one", "len(items) - n:", "len(items) - n + 1:"), ("wrong-name", "len(items) - n", "len(items) - 1")]),
    _f("first_index", """
def first_index(items, target):
    for index in range(len(items)):
        if items[index] == target:
            return index
    return -1
""", [([3, 4, 5], 5), ([3, 4, 5], 3), ([1, 2], 9)],
       [("off-by-one", "range(len(items))", "range(len(items) - 1)"), ("wrong-constant", "return -1", "return 0"),
        ("wrong-name", "            return index", "            return target")]),
    _f("ratio_text", """
def percent(part, whole):
    return {hundred} * part / whole


def ratio_text(part, whole):
    return str(round(percent(part, whole))) + "%"
""", [(1, 4), (3, 3), (1, 8)],
       [("swapped-arguments", "round(percent(part, whole))", "round(percent(whole, part))"),
        ("wrong-constant", "{hundred} * part", "{hundred_bad} * part"), ("wrong-operator", "* part / whole", "* part * whole")],
       hundred=(100,)),
    _f("to_fahrenheit", """
def to_fahrenheit(celsius):
    return celsius * 9 / 5 + {freezing}
""", [(0,), (100,), (-40,)],
       [("wrong-constant", "+ {freezing}", "+ {freezing_bad}"), ("wrong-operator", "9 / 5", "9 * 5")], freezing=(32,)),
    _f("is_leap", """
def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
""", [(2024,), (1900,), (2000,), (2023,)],
       [("wrong-operator", "year % 100 != 0", "year % 100 == 0"), ("wrong-constant", "year % 400", "year % 401")]),
    _f("shout", """
def repeat(word, times, separator):
    return separator.join([word] * times)


def shout(word, times):
    return repeat(word.upper(), times, "-")
""", [("ab", 3), ("x", 1), ("hey", 2)],
       [("swapped-arguments", "repeat(word.upper(), times, \"-\")", "repeat(\"-\", times, word.upper())"),
        ("wrong-name", "[word] * times", "[separator] * times")]),
    _f("total_price", """
def total_price(unit_price, quantity, discount):
    price = unit_price * quantity
    if quantity >= {bulk}:
        price = price - discount
    return price
""", [(2, 10, 5), (3, 1, 5), (4, 9, 1)],
       [("wrong-constant", "quantity >= {bulk}", "quantity >= {bulk_bad}"), ("off-by-one", "quantity >= {bulk}", "quantity > {bulk}"),
        ("wrong-name", "price - discount", "price - quantity")], bulk=(9, 10)),
    _f("window_sums", """
def window_sums(values, width):
    return [sum(values[start:start + width]) for start in range(len(values) - width + 1)]
""", [([1, 2, 3, 4], 2), ([5, 5], 1), ([1, 2, 3], 3)],
       [("off-by-one", "len(values) - width + 1", "len(values) - width"), ("wrong-operator", "start + width", "start - width")]),
)
