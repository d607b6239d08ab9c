"""Small multi-file repositories for `repofix`, generated from templates with random parameters.

Each template writes a package of two modules plus tests, with its constants, package name and
test inputs drawn from the rng. Expected test values are computed here by a separate plain-Python
reimplementation, so a template whose code and tests disagree fails its pristine test run at
generation time instead of producing a task that cannot be solved. Every test has a docstring:
it becomes the "expected behaviour" line of the problem statement when a bug breaks that test.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Repo:
    template: str
    files: dict[str, str]
    sources: list[str]
    """Modules that bugs may be injected into."""
    tests: list[str]


def _test(name: str, doc: str, body: str) -> str:
    return f'def test_{name}():\n    """{doc}"""\n    ' + body.strip().replace("\n", "\n    ") + "\n"


def _test_file(header: str, tests: list[str]) -> str:
    return header + "\n\n\n" + "\n\n".join(tests)


def shop(rng: random.Random) -> Repo:
    pkg = rng.choice(["shop", "store", "market", "till"])
    tax, bulk_qty, bulk_off = rng.choice([5, 8, 10, 20]), rng.choice([3, 5, 10]), rng.choice([5, 10, 15])
    pricing = f'''"""Prices in cents: line totals, discounts and tax."""

TAX_PERCENT = {tax}
BULK_QUANTITY = {bulk_qty}
BULK_PERCENT_OFF = {bulk_off}


def apply_discount(amount, percent):
    """`amount` reduced by `percent` percent, rounded down."""
    return amount * (100 - percent) // 100


def add_tax(amount):
    """`amount` plus tax, rounded down."""
    return amount + amount * TAX_PERCENT // 100


def line_total(price, quantity):
    """Price of `quantity` units; from BULK_QUANTITY units on, the line gets a discount."""
    total = price * quantity
    if quantity >= BULK_QUANTITY:
        total = apply_discount(total, BULK_PERCENT_OFF)
    return total
'''
    cart = f'''"""A shopping cart of (price, quantity) lines."""

from {pkg}.pricing import add_tax, apply_discount, line_total


class Cart:
    def __init__(self):
        self.lines = []

    def add(self, price, quantity=1):
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        self.lines.append((price, quantity))

    def count(self):
        return sum(quantity for _, quantity in self.lines)

    def subtotal(self):
        return sum(line_total(price, quantity) for price, quantity in self.lines)

    def total(self, coupon_percent=0):
        amount = self.subtotal()
        if coupon_percent > 0:
            amount = apply_discount(amount, coupon_percent)
        return add_tax(amount)
'''

    def discount(amount: int, percent: int) -> int:
        return amount * (100 - percent) // 100

    def line(price: int, qty: int) -> int:
        return discount(price * qty, bulk_off) if qty >= bulk_qty else price * qty

    price, amount, coupon = rng.randrange(150, 990, 10), rng.randrange(1000, 9000, 10), rng.choice([10, 20, 25])
    lines = [(rng.randrange(100, 900, 5), rng.randint(1, bulk_qty + 2)) for _ in range(3)]
    subtotal = sum(line(p, q) for p, q in lines)
    adds = "\n".join(f"cart.add({p}, {q})" for p, q in lines)
    pricing_tests = [
        _test(
            "discount",
            f"apply_discount takes {coupon} percent off, rounding down.",
            f"assert apply_discount({amount + 7}, {coupon}) == {discount(amount + 7, coupon)}",
        ),
        _test(
            "tax",
            f"add_tax adds {tax} percent, rounding down.",
            f"assert add_tax({amount + 3}) == {amount + 3 + (amount + 3) * tax // 100}",
        ),
        _test(
            "small_line",
            "line_total charges full price below the bulk quantity.",
            f"assert line_total({price}, {bulk_qty - 1}) == {price * (bulk_qty - 1)}",
        ),
        _test(
            "bulk_line",
            "line_total discounts a line of exactly BULK_QUANTITY units.",
            f"assert line_total({price}, {bulk_qty}) == {line(price, bulk_qty)}",
        ),
    ]
    cart_tests = [
        _test(
            "count",
            "count adds up the quantities.",
            f"cart = Cart()\n{adds}\nassert cart.count() == {sum(q for _, q in lines)}",
        ),
        _test(
            "total",
            "total is the subtotal plus tax.",
            f"cart = Cart()\n{adds}\nassert cart.total() == {subtotal + subtotal * tax // 100}",
        ),
        _test(
            "coupon",
            f"a {coupon} percent coupon applies before tax.",
            f"cart = Cart()\n{adds}\nexpected = {discount(subtotal, coupon)}\n"
            f"assert cart.total({coupon}) == expected + expected * {tax} // 100",
        ),
        _test(
            "bad_quantity", "adding zero units is an error.", "with pytest.raises(ValueError):\n    Cart().add(100, 0)"
        ),
        _test("empty", "an empty cart costs nothing.", "assert Cart().total() == 0"),
    ]
    files = {
        f"{pkg}/__init__.py": "",
        f"{pkg}/pricing.py": pricing,
        f"{pkg}/cart.py": cart,
        "tests/test_pricing.py": _test_file(
            f"from {pkg}.pricing import add_tax, apply_discount, line_total", pricing_tests
        ),
        "tests/test_cart.py": _test_file(f"import pytest\n\nfrom {pkg}.cart import Cart", cart_tests),
    }
    return Repo("shop", files, [f"{pkg}/pricing.py", f"{pkg}/cart.py"], ["tests/test_pricing.py", "tests/test_cart.py"])


VOCABULARY = [
    "river",
    "stone",
    "light",
    "cloud",
    "maple",
    "ember",
    "field",
    "north",
    "quiet",
    "amber",
    "cedar",
    "frost",
]
STOPWORDS = ["the", "a", "of", "and", "to", "in"]


def textkit(rng: random.Random) -> Repo:
    pkg = rng.choice(["textkit", "wordstat", "lexis"])
    min_length = rng.choice([3, 4, 5])
    words_py = f'''"""Splitting text into words."""

STOPWORDS = {{{", ".join(repr(w) for w in STOPWORDS)}}}
MIN_LENGTH = {min_length}


def words(text):
    """Lowercase words of `text`, with surrounding punctuation stripped."""
    result = []
    for raw in text.split():
        word = raw.strip(".,;:!?").lower()
        if word:
            result.append(word)
    return result


def content_words(text):
    """Words that are not stopwords and have at least MIN_LENGTH letters."""
    return [word for word in words(text) if word not in STOPWORDS and len(word) >= MIN_LENGTH]
'''
    stats_py = f'''"""Word statistics."""

from {pkg}.words import content_words, words


def word_counts(text):
    counts = {{}}
    for word in content_words(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n):
    """The `n` most frequent content words, most frequent first, ties in alphabetical order."""
    counts = word_counts(text)
    ranked = sorted(counts, key=lambda word: (-counts[word], word))
    return ranked[:n]


def average_length(text):
    """Mean length of all words, 0.0 for no words."""
    found = words(text)
    if not found:
        return 0.0
    return sum(len(word) for word in found) / len(found)
'''
    pool = rng.sample(VOCABULARY, 5) + ["cat", "sun", "sea", "owl"][: 6 - min_length]
    tokens = [rng.choice(pool + STOPWORDS) for _ in range(18)]
    tokens = [t.capitalize() if rng.random() < 0.2 else t for t in tokens]
    tokens = [t + rng.choice(",.;!") if rng.random() < 0.2 else t for t in tokens]
    text = " ".join(tokens)
    plain = [t.strip(".,;:!?").lower() for t in tokens]
    content = [w for w in plain if w not in STOPWORDS and len(w) >= min_length]
    counts: dict[str, int] = {}
    for w in content:
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    average = sum(len(w) for w in plain) / len(plain)
    short = rng.choice([w for w in ["cat", "sun", "sea", "owl", "elm"] if len(w) < min_length] or ["ox"])
    tests = [
        _test("words", "words lowercases and strips punctuation.", f"assert words({text!r}) == {plain!r}"),
        _test(
            "content",
            "content_words drops stopwords and short words.",
            f"assert content_words({text!r}) == {content!r}",
        ),
        _test(
            "short_word",
            f"a word shorter than {min_length} letters is not a content word.",
            f"assert content_words({short!r}) == []",
        ),
        _test("counts", "word_counts counts each content word.", f"assert word_counts({text!r}) == {counts!r}"),
        _test(
            "top", "top_words ranks by count, then alphabetically.", f"assert top_words({text!r}, 3) == {ranked[:3]!r}"
        ),
        _test(
            "average",
            "average_length is the mean word length.",
            f"assert abs(average_length({text!r}) - {average!r}) < 1e-9",
        ),
        _test("empty", "an empty text has average length 0.", 'assert average_length("") == 0.0'),
    ]
    files = {
        f"{pkg}/__init__.py": "",
        f"{pkg}/words.py": words_py,
        f"{pkg}/stats.py": stats_py,
        "tests/test_text.py": _test_file(
            f"from {pkg}.stats import average_length, top_words, word_counts\n"
            f"from {pkg}.words import content_words, words",
            tests,
        ),
    }
    return Repo("textkit", files, [f"{pkg}/words.py", f"{pkg}/stats.py"], ["tests/test_text.py"])


def life(rng: random.Random) -> Repo:
    pkg = rng.choice(["life", "cells", "automaton"])
    width, height = rng.randint(5, 8), rng.randint(5, 8)
    board_py = '''"""A bounded board of live cells."""


class Board:
    def __init__(self, width, height, alive=()):
        self.width = width
        self.height = height
        self.alive = {cell for cell in alive if self.inside(*cell)}

    def inside(self, x, y):
        return 0 <= x < self.width and 0 <= y < self.height

    def neighbours(self, x, y):
        """Live cells among the eight around (x, y)."""
        count = 0
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                if (dx or dy) and (x + dx, y + dy) in self.alive:
                    count += 1
        return count
'''
    rules_py = f'''"""Conway's Game of Life (B3/S23) on a bounded board."""

from {pkg}.board import Board


def step(board):
    """The next generation: born with 3 neighbours, survives with 2 or 3."""
    alive = set()
    for x in range(board.width):
        for y in range(board.height):
            count = board.neighbours(x, y)
            if count == 3 or (count == 2 and (x, y) in board.alive):
                alive.add((x, y))
    return Board(board.width, board.height, alive)


def population(board, generations):
    """Live cells after `generations` steps."""
    for _ in range(generations):
        board = step(board)
    return len(board.alive)
'''

    def neighbours(alive: set, x: int, y: int) -> int:
        return sum((x + dx, y + dy) in alive for dx in (-1, 0, 1) for dy in (-1, 0, 1) if dx or dy)

    def next_gen(alive: set) -> set:
        return {
            (x, y)
            for x in range(width)
            for y in range(height)
            if neighbours(alive, x, y) == 3 or (neighbours(alive, x, y) == 2 and (x, y) in alive)
        }

    cells = {(rng.randrange(width), rng.randrange(height)) for _ in range(width * height // 3)}
    gen1, generations = next_gen(cells), rng.randint(2, 4)
    later = cells
    for _ in range(generations):
        later = next_gen(later)
    x, y = rng.randrange(width), rng.randrange(height)
    board = f"Board({width}, {height}, {sorted(cells)!r})"
    tests = [
        _test(
            "inside",
            "cells on the far edge are outside the board.",
            f"board = Board({width}, {height})\nassert board.inside({width - 1}, {height - 1})\n"
            f"assert not board.inside({width}, 0) and not board.inside(0, {height})",
        ),
        _test(
            "neighbours",
            "neighbours counts the eight surrounding cells.",
            f"assert {board}.neighbours({x}, {y}) == {neighbours(cells, x, y)}",
        ),
        _test(
            "blinker",
            "a blinker flips between a row and a column.",
            "board = step(Board(5, 5, [(1, 2), (2, 2), (3, 2)]))\nassert board.alive == {(2, 1), (2, 2), (2, 3)}",
        ),
        _test("step", "step applies B3/S23 to every cell.", f"assert step({board}).alive == set({sorted(gen1)!r})"),
        _test(
            "population",
            f"population counts live cells after {generations} steps.",
            f"assert population({board}, {generations}) == {len(later)}",
        ),
        _test("corner", "a lone corner cell dies.", "assert population(Board(3, 3, [(0, 0)]), 1) == 0"),
    ]
    files = {
        f"{pkg}/__init__.py": "",
        f"{pkg}/board.py": board_py,
        f"{pkg}/rules.py": rules_py,
        "tests/test_life.py": _test_file(
            f"from {pkg}.board import Board\nfrom {pkg}.rules import population, step", tests
        ),
    }
    return Repo("life", files, [f"{pkg}/board.py", f"{pkg}/rules.py"], ["tests/test_life.py"])


TEMPLATES: dict[str, Callable[[random.Random], Repo]] = {"shop": shop, "textkit": textkit, "life": life}
