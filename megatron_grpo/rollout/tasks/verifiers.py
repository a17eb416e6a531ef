"""Built-in verifiers, usable by name as ``rollout.reward_fn: exact_match`` or ``math``.

Both take verl's keywords (``data_source``, ``solution_str``, ``ground_truth``, ``extra_info``)
and return 1.0 or 0.0:

* ``exact_match``: the response equals the ground truth, both stripped of surrounding
  whitespace.
* ``math``: the answer of the response (the content of its last ``\\boxed{...}``, else the text
  after its last GSM8K ``####``) equals the ground truth (whose own ``\\boxed{}`` / ``####``
  answer is taken when it has one, else the whole string). Answers that are numbers compare as
  numbers (``1,000`` = ``1000``, ``2.50`` = ``2.5``, ``3/4`` = ``\\frac{3}{4}`` = ``0.75``,
  ``5`` = ``5.0``); other answers compare as strings without spaces, ``$`` and ``\\left`` /
  ``\\right``. A response with neither ``\\boxed{}`` nor ``####`` scores 0.

Pure Python (``re`` and ``fractions``): cheap to import in reward worker processes.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?$")
_LATEX_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_NUMBER = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    balanced; None when there is none (or it is not closed)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``: its last ``\\boxed{}``, else what follows its last
    ``####`` (GSM8K), up to the end of that line; None when it has neither."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    return None


def _clean(answer: str) -> str:
    s = answer.strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$"):
        s = s.replace(token, "")
    s = s.replace("\\%", "%").strip().rstrip(".").strip()
    if s.endswith("%"):  # "50%" and "50" are one answer
        s = s[:-1].strip()
    return s


def to_number(answer: str) -> Fraction | None:
    """``answer`` as an exact number (ints, decimals, ``1,234`` thousands, ``a/b`` and
    ``\\frac{a}{b}`` fractions), or None when it is not one."""
    s = _clean(answer).replace(" ", "")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    m = _LATEX_FRAC.match(s)
    if m:
        num, den = to_number(m.group(2)), to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) == "-" else num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = to_number(num_s), to_number(den_s)
        if num is None or den is None or den == 0:
            return None
        return num / den
    if not _NUMBER.match(s):
        return None
    return Fraction(s)


def answers_equal(a: str, b: str) -> bool:
    """Equal as numbers when both are numbers, else as cleaned strings without spaces."""
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb
    return _clean(a).replace(" ", "") == _clean(b).replace(" ", "")


def exact_match(
    data_source: str = "", solution_str: str = "", ground_truth: Any = "", extra_info: Any = None
) -> float:
    """1.0 when the response equals the ground truth (surrounding whitespace ignored)."""
    return float(solution_str.strip() == str(ground_truth).strip())


def math(
    data_source: str = "", solution_str: str = "", ground_truth: Any = "", extra_info: Any = None
) -> float:
    """1.0 when the response's final answer (last ``\\boxed{}``, else GSM8K ``####``) equals the
    ground truth's, numbers compared as numbers."""
    got = extract_answer(solution_str)
    if got is None:
        return 0.0
    truth = str(ground_truth)
    want = extract_answer(truth)
    return float(answers_equal(got, truth if want is None else want))


VERIFIERS = {"exact_match": exact_match, "math": math}
