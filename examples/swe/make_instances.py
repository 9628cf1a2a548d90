"""Build the shipped SWE-bench-format instances: small real git repositories and their instances.jsonl.

    python -m examples.swe.make_instances [OUT]     # default: ~/.cache/lightning-lite/swe-instances/<version>

OUT gets ``repos/<owner>__<name>`` (git repositories with their whole history, the fixes included) and
``instances.jsonl`` (one instance per line, the fields of SWE-bench). Three repositories, five instances; each
repository has several commits by fixed authors on fixed dates (so every SHA is the same on every machine), a
bug that came in with a plausible change, the base commit a little later, then the fix commit (code and tests
together, as a pull request) and more history and tags after it: what the agent must never see.

``patch`` and ``test_patch`` are the fix commit's diff against its base, split by path (the test files go into
``test_patch``, as SWE-bench splits a pull request). FAIL_TO_PASS and PASS_TO_PASS are pytest ids, written as JSON
strings of lists like SWE-bench's dataset; ``python -m examples.swe.instances OUT/instances.jsonl --check``
verifies them (every FAIL_TO_PASS test fails at the base commit, everything passes with ``patch``).

Deterministic and offline; about a second. Both files are generated, not committed, so the SHAs in the JSONL are
always those of the repositories beside it (whatever git's defaults become). No network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# ---------------------------------------------------------------------------- acme/textkit (flat layout)

SLUG_V1 = '''import re
import unicodedata


def slugify(text, sep="-"):
    """A lower-case ASCII slug of text: each run of other characters becomes one sep, none at the ends."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return sep.join(re.findall(r"[a-z0-9]+", text.lower()))
'''

SLUG_V2 = '''import unicodedata


def slugify(text, sep="-", keep="_"):
    """A lower-case ASCII slug of text: each run of other characters becomes one sep, none at the ends.

    Characters in ``keep`` are kept as they are (``"snake_case"`` stays ``"snake_case"``).
    """
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii").lower()
    out = []
    for ch in text:
        if ch.isalnum() or ch in keep:
            out.append(ch)
        else:
            out.append(sep)
    return "".join(out).strip(sep)
'''

SLUG_FIXED = SLUG_V2.replace(
    """        else:
            out.append(sep)
""",
    """        elif out and out[-1] != sep:  # one sep per run, none at the start
            out.append(sep)
""",
)

TEST_SLUG = """from textkit import slugify


def test_basic():
    assert slugify("Hello World") == "hello-world"


def test_unicode():
    assert slugify("Crème Brûlée") == "creme-brulee"


def test_custom_separator():
    assert slugify("a b", sep="_") == "a_b"
"""

TEST_SLUG_V2 = (
    TEST_SLUG
    + """

def test_keeps_underscores():
    assert slugify("snake_case name") == "snake_case-name"
"""
)

TEST_SLUG_FIXED = (
    TEST_SLUG_V2
    + """

def test_collapses_runs():
    assert slugify("Hello,  World!") == "hello-world"
    assert slugify("--a--b--") == "a-b"


def test_custom_separator_collapses():
    assert slugify("one / two", sep="+") == "one+two"
"""
)

WRAP = '''def wrap(text, width=70):
    """Break text into lines of at most width characters, at spaces (a longer word gets a line of its own)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
'''

WRAP_NONE = WRAP.replace(
    '''    lines, line = [], ""''',
    '''    if width is None:  # no limit: one line
        return [" ".join(text.split())] if text.split() else []
    lines, line = [], ""''',
)

TEST_WRAP = """import pytest

from textkit import wrap


def test_short_line():
    assert wrap("a b c", 10) == ["a b c"]


@pytest.mark.parametrize("text,width,n", [("the quick brown fox", 10, 2), ("jumps over the lazy dog", 5, 5)])
def test_line_count(text, width, n):
    assert len(wrap(text, width)) == n


def test_long_word():
    assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]
"""

TEST_WRAP_NONE = (
    TEST_WRAP
    + """

def test_no_width():
    assert wrap("a  b   c", None) == ["a b c"]
"""
)

CASE = '''def camel_to_snake(name):
    """"parseHTTPResponse" -> "parse_http_response"; a snake_case name comes back lower-cased."""
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i > 0 and name[i - 1] != "_":
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def snake_to_camel(name):
    """"parse_http_response" -> "parseHttpResponse"."""
    first, *rest = name.split("_")
    return first + "".join(w.capitalize() for w in rest)
'''

CASE_FIXED = '''import re

# Between a lower-case letter or digit and an upper-case one ("eH"), and before the last capital of an acronym
# that a word follows ("PR" in "HTTPResponse").
_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def camel_to_snake(name):
    """"parseHTTPResponse" -> "parse_http_response"; a snake_case name comes back lower-cased."""
    return _BOUNDARY.sub("_", name).lower()


def snake_to_camel(name):
    """"parse_http_response" -> "parseHttpResponse"."""
    first, *rest = name.split("_")
    return first + "".join(w.capitalize() for w in rest)
'''

TEST_CASE = """import pytest

from textkit.case import camel_to_snake, snake_to_camel


@pytest.mark.parametrize("name,want", [("simpleName", "simple_name"), ("getX", "get_x"), ("Already_snake", "already_snake")])
def test_camel_to_snake(name, want):
    assert camel_to_snake(name) == want


def test_snake_to_camel():
    assert snake_to_camel("parse_http_response") == "parseHttpResponse"
"""

TEST_CASE_FIXED = TEST_CASE.replace(
    '("Already_snake", "already_snake")]',
    '("Already_snake", "already_snake"),\n'
    '                                       ("parseHTTPResponse", "parse_http_response"), ("HTTPServer", "http_server")]',
)

TEXTKIT_README = """# textkit

Small text helpers: `slugify`, `wrap`, `camel_to_snake` / `snake_to_camel`.

    >>> from textkit import slugify
    >>> slugify("Hello World")
    'hello-world'

Run the tests with `python -m pytest`.
"""

# ---------------------------------------------------------------------------- acme/ledger (src layout)

MONEY = '''from dataclasses import dataclass


@dataclass(frozen=True)
class Money:
    """An amount in cents of one currency."""

    cents: int
    currency: str = "EUR"

    def __add__(self, other):
        if other.currency != self.currency:
            raise ValueError(f"cannot add {other.currency} to {self.currency}")
        return Money(self.cents + other.cents, self.currency)

    def __str__(self):
        sign = "-" if self.cents < 0 else ""
        return f"{sign}{abs(self.cents) // 100}.{abs(self.cents) % 100:02d} {self.currency}"
'''

MONEY_PARSE = (
    MONEY
    + '''
    @classmethod
    def parse(cls, text, currency="EUR"):
        """ "12.50" -> Money(1250); "3" -> Money(300); "-0.05" -> Money(-5)."""
        whole, _, frac = text.strip().partition(".")
        return cls(int(whole) * 100 + int(frac or 0), currency)
'''
)

MONEY_PARSE_FIXED = (
    MONEY
    + '''
    @classmethod
    def parse(cls, text, currency="EUR"):
        """ "12.50" -> Money(1250); "3" -> Money(300); "-0.05" -> Money(-5)."""
        return cls(parse_cents(text), currency)
'''
)
MONEY_PARSE_FIXED = MONEY_PARSE_FIXED.replace(
    "from dataclasses import dataclass\n",
    "from dataclasses import dataclass\n\nfrom ledger._parse import parse_cents\n",
)

PARSE_NEW = '''import re

_AMOUNT = re.compile(r"(-?)(\\d+)(?:\\.(\\d{1,2}))?")


def parse_cents(text):
    """A decimal amount with at most two decimals ("12.5", "-0.05", "3") in cents."""
    m = _AMOUNT.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not an amount: {text!r}")
    sign, whole, frac = m.groups()
    cents = int(whole) * 100 + int((frac or "").ljust(2, "0"))
    return -cents if sign else cents
'''

SPLIT_V1 = '''def split_evenly(total, n):
    """Split total cents into n parts that add up to total and differ by at most one cent (larger first)."""
    if n <= 0:
        raise ValueError("n must be positive")
    parts = []
    for i in range(n):
        parts.append(total // n + (1 if i < total % n else 0))
    return parts
'''

SPLIT_V2 = '''def split_evenly(total, n):
    """Split total cents into n parts that add up to total and differ by at most one cent (larger first)."""
    if n <= 0:
        raise ValueError("n must be positive")
    return [total // n] * n


def allocate(total, weights):
    """Split total cents in proportion to weights (the rounding goes to the first parts)."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    for i in range(total - sum(parts)):
        parts[i] += 1
    return parts
'''

SPLIT_FIXED = SPLIT_V2.replace(
    "    return [total // n] * n\n",
    "    share, extra = divmod(total, n)\n    return [share + 1] * extra + [share] * (n - extra)\n",
)

TEST_MONEY = """import pytest

from ledger import Money


def test_add():
    assert Money(150) + Money(275) == Money(425)


def test_add_other_currency():
    with pytest.raises(ValueError):
        Money(1, "EUR") + Money(1, "USD")


def test_str():
    assert str(Money(-1205, "USD")) == "-12.05 USD"
"""

TEST_MONEY_PARSE = (
    TEST_MONEY
    + """

def test_parse_whole():
    assert Money.parse("3") == Money(300)


def test_parse_cents():
    assert Money.parse("12.25") == Money(1225)
"""
)

TEST_MONEY_PARSE_FIXED = (
    TEST_MONEY_PARSE
    + """

def test_parse_one_decimal():
    assert Money.parse("12.5") == Money(1250)


def test_parse_negative():
    assert Money.parse("-0.05") == Money(-5)
    assert Money.parse("-1.25") == Money(-125)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        Money.parse("1.234")
"""
)

TEST_SPLIT = """from ledger.split import split_evenly


def test_even():
    assert split_evenly(300, 3) == [100, 100, 100]


def test_one_part():
    assert split_evenly(7, 1) == [7]
"""

TEST_SPLIT_V2 = (
    TEST_SPLIT.replace(
        "from ledger.split import split_evenly", "from ledger.split import allocate, split_evenly"
    )
    + """

def test_allocate():
    assert allocate(100, [1, 1, 2]) == [25, 25, 50]
"""
)

TEST_SPLIT_FIXED = (
    TEST_SPLIT_V2
    + """

def test_remainder_is_kept():
    assert split_evenly(100, 3) == [34, 33, 33]
    assert sum(split_evenly(1001, 7)) == 1001
"""
)

LEDGER_INIT = '"""Money amounts in cents and ways to split them."""\n\nfrom ledger.money import Money\n\n__all__ = ["Money"]\n'
LEDGER_README = """# ledger

Money in integer cents (`Money`), split evenly or by weights (`ledger.split`).

The package is under `src/`: run the tests with `PYTHONPATH=src python -m pytest`.
"""
LEDGER_PYPROJECT = """[project]
name = "ledger"
version = "0.1.0"
requires-python = ">=3.9"

[tool.setuptools.packages.find]
where = ["src"]
"""

# ---------------------------------------------------------------------------- acme/intervals

INTERVALS = '''def merge(intervals):
    """Merge closed intervals [a, b] that overlap or touch; the result is sorted and disjoint."""
    out = []
    for a, b in intervals:
        if out and a < out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def total_length(intervals):
    """The length of the union of the intervals."""
    return sum(b - a for a, b in merge(intervals))
'''

INTERVALS_FIXED = INTERVALS.replace(
    """    out = []
    for a, b in intervals:
        if out and a < out[-1][1]:""",
    """    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:  # closed intervals: [1, 3] and [3, 5] touch""",
)

TEST_INTERVALS = """from intervals import merge, total_length


def test_disjoint():
    assert merge([(1, 2), (4, 5)]) == [(1, 2), (4, 5)]


def test_overlap():
    assert merge([(1, 4), (2, 6)]) == [(1, 6)]


def test_total_length():
    assert total_length([(0, 10), (5, 20)]) == 20
"""

TEST_INTERVALS_FIXED = (
    TEST_INTERVALS
    + """

def test_touching():
    assert merge([(1, 3), (3, 5)]) == [(1, 5)]


def test_unsorted():
    assert merge([(6, 8), (1, 2), (2, 4)]) == [(1, 4), (6, 8)]
    assert total_length([(5, 20), (0, 10)]) == 20
"""
)

INTERVALS_INIT_V1 = (
    '"""Closed intervals of numbers."""\n\nfrom intervals.core import merge, total_length\n'
)
INTERVALS_INIT = INTERVALS_INIT_V1 + '\n__version__ = "0.2.0"\n'
INTERVALS_README = "# intervals\n\n`merge` and `total_length` for closed intervals `(a, b)`.\n"

# ---------------------------------------------------------------------------- the histories
# Each repository: a list of commits (label, author, message, {path: text, or None to delete}). An instance names
# its base commit and its fix commit (a child of the base); tags point at labelled commits.

AUTHORS = {
    "ada": ("Ada Byron", "ada@acme.example"),
    "lin": ("Lin Chen", "lin@acme.example"),
    "sam": ("Sam Okafor", "sam@acme.example"),
}

PYPROJECT = '[project]\nname = "{name}"\nversion = "{version}"\nrequires-python = ">=3.9"\n'

REPOS = {
    "acme/textkit": dict(
        commits=[
            (
                "init",
                "ada",
                "Initial commit: slugify",
                {
                    "README.md": TEXTKIT_README.replace(
                        ", `wrap`, `camel_to_snake` / `snake_to_camel`", ""
                    ),
                    "pyproject.toml": PYPROJECT.format(name="textkit", version="0.1.0"),
                    ".gitignore": "__pycache__/\n*.egg-info/\n",
                    "textkit/__init__.py": 'from textkit.slug import slugify\n\n__all__ = ["slugify"]\n',
                    "textkit/slug.py": SLUG_V1,
                    "tests/test_slug.py": TEST_SLUG,
                },
            ),
            (
                "wrap",
                "lin",
                "Add wrap() for plain-text reports",
                {
                    "README.md": TEXTKIT_README.replace(
                        ", `camel_to_snake` / `snake_to_camel`", ""
                    ),
                    "textkit/__init__.py": 'from textkit.slug import slugify\nfrom textkit.wrap import wrap\n\n__all__ = ["slugify", "wrap"]\n',
                    "textkit/wrap.py": WRAP,
                    "tests/test_wrap.py": TEST_WRAP,
                },
            ),
            (
                "refactor",
                "sam",
                "slug: keep underscores (keep=), no regex on the hot path",
                {"textkit/slug.py": SLUG_V2, "tests/test_slug.py": TEST_SLUG_V2},
            ),
            (
                "docs",
                "ada",
                "README: mention keep=",
                {
                    "README.md": TEXTKIT_README.replace(
                        ", `camel_to_snake` / `snake_to_camel`", ""
                    ).replace(
                        "Run the tests",
                        '`slugify(text, keep="_.")` keeps underscores and dots.\n\nRun the tests',
                    )
                },
            ),
            (
                "fix12",
                "lin",
                "slug: collapse runs of separators again (fixes #12)",
                {"textkit/slug.py": SLUG_FIXED, "tests/test_slug.py": TEST_SLUG_FIXED},
            ),
            (
                "case",
                "sam",
                "Add camel_to_snake / snake_to_camel",
                {
                    "README.md": TEXTKIT_README.replace(
                        "Run the tests",
                        '`slugify(text, keep="_.")` keeps underscores and dots.\n\nRun the tests',
                    ),
                    "textkit/case.py": CASE,
                    "tests/test_case.py": TEST_CASE,
                },
            ),
            (
                "wrapnone",
                "ada",
                "wrap: width=None means one line",
                {"textkit/wrap.py": WRAP_NONE, "tests/test_wrap.py": TEST_WRAP_NONE},
            ),
            (
                "fix15",
                "lin",
                "case: keep acronyms together in camel_to_snake (fixes #15)",
                {"textkit/case.py": CASE_FIXED, "tests/test_case.py": TEST_CASE_FIXED},
            ),
            (
                "bump",
                "ada",
                "Release 0.3.0",
                {"pyproject.toml": PYPROJECT.format(name="textkit", version="0.3.0")},
            ),
        ],
        tags={"v0.1.0": "wrap", "v0.2.0": "fix12", "v0.3.0": "bump"},
    ),
    "acme/ledger": dict(
        commits=[
            (
                "init",
                "sam",
                "Money in integer cents",
                {
                    "README.md": LEDGER_README.replace(
                        ", split evenly or by weights (`ledger.split`)", ""
                    ),
                    "pyproject.toml": LEDGER_PYPROJECT,
                    ".gitignore": "__pycache__/\n",
                    "src/ledger/__init__.py": LEDGER_INIT,
                    "src/ledger/money.py": MONEY,
                    "tests/test_money.py": TEST_MONEY,
                },
            ),
            (
                "split",
                "sam",
                "Add split_evenly",
                {
                    "README.md": LEDGER_README,
                    "src/ledger/split.py": SPLIT_V1,
                    "tests/test_split.py": TEST_SPLIT,
                },
            ),
            (
                "allocate",
                "ada",
                "split: add allocate(); simplify split_evenly",
                {"src/ledger/split.py": SPLIT_V2, "tests/test_split.py": TEST_SPLIT_V2},
            ),
            (
                "fix4",
                "lin",
                "split_evenly: hand out the remainder cents (fixes #4)",
                {"src/ledger/split.py": SPLIT_FIXED, "tests/test_split.py": TEST_SPLIT_FIXED},
            ),
            (
                "parse",
                "ada",
                "Money.parse for amounts typed by users",
                {"src/ledger/money.py": MONEY_PARSE, "tests/test_money.py": TEST_MONEY_PARSE},
            ),
            (
                "ci",
                "sam",
                "README: how to run the tests",
                {
                    "README.md": LEDGER_README
                    + "\nThe CI runs the same command on Python 3.9 to 3.12.\n"
                },
            ),
            (
                "fix7",
                "lin",
                "Money.parse: one decimal, negative amounts, reject garbage (fixes #7)",
                {
                    "src/ledger/money.py": MONEY_PARSE_FIXED,
                    "src/ledger/_parse.py": PARSE_NEW,
                    "tests/test_money.py": TEST_MONEY_PARSE_FIXED,
                },
            ),
        ],
        tags={"v0.1.0": "split", "v0.2.0": "fix7"},
    ),
    "acme/intervals": dict(
        commits=[
            (
                "init",
                "lin",
                "merge() for closed intervals",
                {
                    "README.md": INTERVALS_README,
                    "pyproject.toml": PYPROJECT.format(name="intervals", version="0.1.0"),
                    "intervals/__init__.py": INTERVALS_INIT_V1.replace(", total_length", ""),
                    "intervals/core.py": INTERVALS.split("\n\ndef total_length")[0]
                    .replace(
                        "    for a, b in intervals:\n        if out and a < out[-1][1]:",
                        "    for a, b in sorted(intervals):\n        if out and a <= out[-1][1]:",
                    )
                    .rstrip()
                    + "\n",
                    "tests/test_intervals.py": TEST_INTERVALS.replace(", total_length", "")
                    .split("\n\ndef test_total_length")[0]
                    .rstrip()
                    + "\n",
                },
            ),
            (
                "length",
                "sam",
                "Add total_length(); merge() in one pass",
                {
                    "intervals/__init__.py": INTERVALS_INIT,
                    "intervals/core.py": INTERVALS,
                    "pyproject.toml": PYPROJECT.format(name="intervals", version="0.2.0"),
                    "tests/test_intervals.py": TEST_INTERVALS,
                },
            ),
            (
                "typing",
                "ada",
                "Document the interval type",
                {
                    "README.md": INTERVALS_README
                    + "\nAn interval is a pair `(a, b)` with `a <= b`; both ends belong to it.\n"
                },
            ),
            (
                "fix3",
                "lin",
                "merge: sort first, merge touching intervals (fixes #3)",
                {
                    "intervals/core.py": INTERVALS_FIXED,
                    "tests/test_intervals.py": TEST_INTERVALS_FIXED,
                },
            ),
            (
                "drop-py38",
                "sam",
                "Require Python 3.9",
                {"pyproject.toml": PYPROJECT.format(name="intervals", version="0.2.1")},
            ),
        ],
        tags={"v0.2.0": "length", "v0.2.1": "drop-py38"},
    ),
}

LEDGER_TEST_CMD = "PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider"

INSTANCES = [  # repo, number, base label, fix label, issue, FAIL_TO_PASS, PASS_TO_PASS, extra fields
    (
        "acme/textkit",
        12,
        "docs",
        "fix12",
        "slugify no longer collapses runs of punctuation and spaces\n\n"
        "Since the `keep=` change, every character that is not kept becomes its own separator:\n\n"
        "    >>> slugify(\"Hello,  World!\")\n    'hello---world'\n\n"
        "It used to return `'hello-world'`, and our URLs now have triple dashes in them. Leading and trailing "
        "runs should still disappear (`slugify(\"--a--b--\")` should be `'a-b'`), also with a custom `sep`.",
        [
            "tests/test_slug.py::test_collapses_runs",
            "tests/test_slug.py::test_custom_separator_collapses",
        ],
        [
            "tests/test_slug.py::test_basic",
            "tests/test_slug.py::test_unicode",
            "tests/test_slug.py::test_custom_separator",
            "tests/test_slug.py::test_keeps_underscores",
            "tests/test_wrap.py::test_short_line",
            "tests/test_wrap.py::test_line_count[the quick brown fox-10-2]",
            "tests/test_wrap.py::test_long_word",
        ],
        {},
    ),
    (
        "acme/textkit",
        15,
        "wrapnone",
        "fix15",
        "camel_to_snake splits acronyms into single letters\n\n"
        "`camel_to_snake(\"parseHTTPResponse\")` returns `'parse_h_t_t_p_response'`; I expected "
        "`'parse_http_response'`. Same for `camel_to_snake(\"HTTPServer\")`, which should be `'http_server'`.",
        [
            "tests/test_case.py::test_camel_to_snake[parseHTTPResponse-parse_http_response]",
            "tests/test_case.py::test_camel_to_snake[HTTPServer-http_server]",
        ],
        [
            "tests/test_case.py::test_camel_to_snake[simpleName-simple_name]",
            "tests/test_case.py::test_camel_to_snake[getX-get_x]",
            "tests/test_case.py::test_camel_to_snake[Already_snake-already_snake]",
            "tests/test_case.py::test_snake_to_camel",
            "tests/test_slug.py::test_collapses_runs",
            "tests/test_wrap.py::test_no_width",
        ],
        {},
    ),
    (
        "acme/ledger",
        4,
        "allocate",
        "fix4",
        "split_evenly loses cents\n\n`split_evenly(100, 3)` gives `[33, 33, 33]`: one cent is gone. The parts "
        "should add up to the total and differ by at most a cent, larger parts first (`[34, 33, 33]`).",
        ["tests/test_split.py::test_remainder_is_kept"],
        [
            "tests/test_split.py::test_even",
            "tests/test_split.py::test_one_part",
            "tests/test_split.py::test_allocate",
            "tests/test_money.py::test_add",
        ],
        {"test_cmd": LEDGER_TEST_CMD},
    ),
    (
        "acme/ledger",
        7,
        "ci",
        "fix7",
        "Money.parse gets one-decimal and negative amounts wrong\n\n"
        "    >>> Money.parse(\"12.5\")\n    Money(cents=1205, currency='EUR')\n\n"
        'That should be 1250 cents. `Money.parse("-1.25")` gives -75 cents instead of -125, and '
        '`Money.parse("1.234")` should raise a ValueError instead of returning 334 cents.',
        [
            "tests/test_money.py::test_parse_one_decimal",
            "tests/test_money.py::test_parse_negative",
            "tests/test_money.py::test_parse_rejects_garbage",
        ],
        [
            "tests/test_money.py::test_parse_whole",
            "tests/test_money.py::test_parse_cents",
            "tests/test_money.py::test_str",
            "tests/test_money.py::test_add_other_currency",
            "tests/test_split.py::test_remainder_is_kept",
        ],
        {"test_cmd": LEDGER_TEST_CMD},
    ),
    (
        "acme/intervals",
        3,
        "typing",
        "fix3",
        "merge() does not merge touching or unsorted intervals\n\n"
        "`merge([(1, 3), (3, 5)])` returns both intervals, but they share the point 3 and should become `(1, 5)`. "
        "And since 0.2.0 the input has to be sorted: `merge([(6, 8), (1, 2), (2, 4)])` is wrong, "
        "and so is `total_length` of unsorted intervals.",
        ["tests/test_intervals.py::test_touching", "tests/test_intervals.py::test_unsorted"],
        [
            "tests/test_intervals.py::test_disjoint",
            "tests/test_intervals.py::test_overlap",
            "tests/test_intervals.py::test_total_length",
        ],
        {},
    ),
]


def is_test_file(path: str) -> bool:
    """How the fix commits are split into patch and test_patch (their tests all live under tests/)."""
    return path.startswith("tests/")


# ---------------------------------------------------------------------------- building


def _env(author: str, when: int) -> dict:
    """Pinned identity, dates and config: the same SHAs on every machine."""
    name, email = AUTHORS[author]
    date = f"{1709287200 + when * 86400 + when * 3671} +0000"  # from 2024-03-01 10:00 UTC, a day and an hour apart
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.devnull,
        "LANG": "C",
        "TZ": "UTC",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": date,
    }


def _git(repo, *args, env=None) -> str:
    p = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env or _env("ada", 0)
    )
    if p.returncode:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {p.stderr.strip()}")
    return p.stdout


def build_repo(path: Path, spec: dict) -> dict:
    """The repository's history; returns {label: sha}."""
    _git(path.parent, "init", "-q", "-b", "main", path.name)
    shas, n = {}, 0
    for label, author, message, files in spec["commits"]:
        for name, text in files.items():
            f = path / name
            if text is None:
                f.unlink()
            else:
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
        env = _env(author, n)
        _git(path, "add", "-A", env=env)
        _git(path, "commit", "-q", "--no-verify", "-m", message, env=env)
        shas[label] = _git(path, "rev-parse", "HEAD").strip()
        n += 1
    for tag, label in spec["tags"].items():
        _git(path, "tag", tag, shas[label], env=_env("ada", n))
    return shas


def build(out: Path) -> Path:
    """Write OUT/repos/* and OUT/instances.jsonl (replacing them); return the JSONL's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
    try:
        shas = {}
        (tmp / "repos").mkdir()
        for repo, spec in REPOS.items():
            shas[repo] = build_repo(tmp / "repos" / repo.replace("/", "__"), spec)
        lines = []
        for repo, number, base, fix, issue, f2p, p2p, extra in INSTANCES:
            path, b, f = tmp / "repos" / repo.replace("/", "__"), shas[repo][base], shas[repo][fix]
            assert _git(path, "rev-parse", f + "^").strip() == b, (
                repo,
                number,
            )  # the fix is a child of the base
            changed = _git(path, "diff", "--name-only", "--no-renames", b, f).split()
            diff = lambda paths: _git(path, "diff", "--binary", "--no-renames", b, f, "--", *paths)  # noqa: E731
            inst = {
                "instance_id": f"{repo.replace('/', '__')}-{number}",
                "repo": repo,
                "base_commit": b,
                "problem_statement": issue,
                "patch": diff([p for p in changed if not is_test_file(p)]),
                "test_patch": diff([p for p in changed if is_test_file(p)]),
                "FAIL_TO_PASS": json.dumps(f2p),
                "PASS_TO_PASS": json.dumps(p2p),
                "created_at": _git(path, "show", "-s", "--format=%cI", f).strip(),
                "version": "0.1",
                **extra,
            }
            lines.append(json.dumps(inst) + "\n")
        (tmp / "instances.jsonl").write_text("".join(lines))
        for name in (
            "repos",
            "instances.jsonl",
        ):  # the JSONL last: its presence says the build is whole
            if (out / name).exists():
                shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        os.replace(tmp / "repos", out / "repos")
        os.replace(tmp / "instances.jsonl", out / "instances.jsonl")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "instances.jsonl"


def default_dir() -> Path:
    """Under the cache (LIGHTNING_LITE_CACHE moves it), versioned by this file's text: an edit here builds anew."""
    from lightning_lite.models import cache_dir

    version = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return Path(cache_dir()) / "swe-instances" / version


if __name__ == "__main__":
    target = build(Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir())
    print(f"{len(INSTANCES)} instances in {target}; repositories in {target.parent / 'repos'}")
