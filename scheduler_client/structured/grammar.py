"""The grammar dialect of structured outputs (GBNF / xgrammar EBNF): its parser and derivation heights.

:class:`Grammar` parses a grammar (raising :class:`SpecProblem` with the line and column of what
is wrong) into rules of nodes, and works out how deep each rule must nest to finish; validation
needs that (root must be able to finish), and so does the example writer (to find its way out).
The dialect is described in :mod:`scheduler_client.structured`.
"""

from __future__ import annotations

import string
from typing import Any

from scheduler_client.structured.spec import MAX_COUNT, MAX_NESTING, SpecProblem

INF = float("inf")
_NAME_START = set(string.ascii_letters + "_")
_NAME_CHARS = set(string.ascii_letters + string.digits + "_-.")
_SIMPLE_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "a": "\a",
    "e": "\x1b",
    "0": "\0",
}
_CLASS_ESCAPES = {**_SIMPLE_ESCAPES, "[": "[", "]": "]", "-": "-", "^": "^", "/": "/"}
_HEX_ESCAPES = {"x": (1, 2), "u": (4, 4), "U": (8, 8)}

# Nodes: ("lit", text) ("cls", negated, ((lo, hi), ...)) ("ref", name) ("seq", [nodes])
#        ("alt", [nodes]) ("rep", node, lo, hi or None)


class Grammar:
    """A parsed EBNF grammar: its rules and their shortest derivation heights."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise SpecProblem("", 'the grammar is empty; expected rules such as root ::= "yes" | "no"')
        self.text = text
        self.i = 0
        self.rules: dict[str, Any] = {}
        self.rule_lines: dict[str, int] = {}
        self.refs: list[tuple[str, int]] = []
        self.parse()
        self.heights = self.compute_heights()
        self.alt_heights: dict[int, list[float]] = {}  # per alternation node: its options' heights
        if self.heights["root"] == INF:
            raise SpecProblem(
                "",
                "the root rule can never finish: every way through it needs a rule that recurses "
                "without end (or an empty character class)",
            )

    # ---------------------------------------------------------------- parsing

    def where(self, pos: int) -> str:
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return f"line {line}, column {col}"

    def fail(self, message: str, pos: int | None = None):
        raise SpecProblem("", f"{self.where(self.i if pos is None else pos)}: {message}")

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.i < n:
            ch = text[self.i]
            if ch in " \t\r\n":
                self.i += 1
            elif ch == "#":
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            else:
                break

    def name_at(self, pos: int) -> str | None:
        text = self.text
        if pos >= len(text) or text[pos] not in _NAME_START:
            return None
        end = pos + 1
        while end < len(text) and text[end] in _NAME_CHARS:
            end += 1
        return text[pos:end]

    def starts_rule(self, pos: int) -> bool:
        """Whether a definition ``name ::=`` starts at pos."""
        name = self.name_at(pos)
        if name is None:
            return False
        j = pos + len(name)
        while j < len(self.text) and self.text[j] in " \t":
            j += 1
        return self.text.startswith("::=", j)

    def parse(self) -> None:
        text = self.text
        self.skip()
        while self.i < len(text):
            start = self.i
            name = self.name_at(start)
            if name is None:
                self.fail(f"expected a rule definition such as root ::= ..., found {text[start]!r}")
            self.i += len(name)
            while self.i < len(text) and text[self.i] in " \t":
                self.i += 1
            if not text.startswith("::=", self.i):
                self.fail(f"expected '::=' after the rule name {name!r}")
            self.i += 3
            if name in self.rules:
                self.fail(f"rule {name!r} is defined twice (first on line {self.rule_lines[name]})", start)
            self.rule_lines[name] = text.count("\n", 0, start) + 1
            self.rules[name] = self.alternatives(0, top=True)
            self.skip()
            if self.i < len(text) and not self.starts_rule(self.i):
                ch = text[self.i]
                self.fail(f"unexpected {ch!r}" + (" (no '(' to close)" if ch == ")" else ""))
        if not self.rules:
            raise SpecProblem("", 'the grammar holds only comments; expected rules such as root ::= "yes" | "no"')
        if "root" not in self.rules:
            raise SpecProblem("", "there is no rule named 'root' (the grammar starts at root ::= ...)")
        for name, pos in self.refs:
            if name not in self.rules:
                self.fail(f"rule {name!r} is not defined", pos)

    def alternatives(self, depth: int, top: bool = False) -> Any:
        if depth > MAX_NESTING:
            self.fail(f"parentheses nested more than {MAX_NESTING} deep")
        options = [self.sequence(depth, top)]
        while True:
            self.skip()
            if self.i < len(self.text) and self.text[self.i] == "|":
                self.i += 1
                options.append(self.sequence(depth, top))
            else:
                break
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self, depth: int, top: bool) -> Any:
        text = self.text
        items = []
        while True:
            self.skip()
            if self.i >= len(text) or text[self.i] in "|)" or self.starts_rule(self.i):
                break
            if text.startswith("(=", self.i) or (
                text[self.i] == "(" and text[self.i + 1 :].lstrip(" \t").startswith("=")
            ):
                start = self.i
                if not top or depth:
                    self.fail("a lookahead (= ...) may only end a rule", start)
                self.i = text.index("=", self.i) + 1
                self.sequence(depth + 1, False)  # checked, not used by the example writer
                self.skip()
                if self.i < len(text) and text[self.i] == "|":
                    self.fail("a lookahead (= ...) cannot hold alternatives '|'")
                if self.i >= len(text) or text[self.i] != ")":
                    self.fail("expected ')' to close the lookahead", self.i)
                self.i += 1
                self.skip()
                if self.i < len(text) and not self.starts_rule(self.i):
                    self.fail("a lookahead (= ...) may only end a rule", start)
                break
            items.append(self.postfix(self.element(depth)))
        if not items:
            found = "the end of the grammar" if self.i >= len(text) else repr(text[self.i])
            if self.i < len(text) and self.starts_rule(self.i):
                found = "the next rule"
            self.fail(
                f"expected an element (a string, a character class, a rule name or '('), found {found}"
                + ('; write "" for the empty string' if self.i >= len(text) or text[self.i] in "|)" else "")
            )
        return items[0] if len(items) == 1 else ("seq", items)

    def element(self, depth: int) -> Any:
        text = self.text
        ch = text[self.i]
        if ch == '"':
            return ("lit", self.string())
        if ch == "[":
            return self.char_class()
        if ch == "(":
            open_at = self.i
            self.i += 1
            self.skip()
            if self.i < len(text) and text[self.i] == ")":
                self.i += 1
                return ("lit", "")
            node = self.alternatives(depth + 1)
            self.skip()
            if self.i >= len(text) or text[self.i] != ")":
                self.fail(f"expected ')' to close the '(' at {self.where(open_at)}")
            self.i += 1
            return node
        name = self.name_at(self.i)
        if name is not None:
            self.refs.append((name, self.i))
            self.i += len(name)
            return ("ref", name)
        if ch == ".":
            self.fail(
                "'.' (any character) is not supported in this grammar dialect; use a character class such as [^\\n]"
            )
        if ch == "'":
            self.fail('strings are written in double quotes ("...")')
        if ch in "*+?{":
            self.fail(f"{ch!r} must follow an element (to repeat a repetition, add parentheses)")
        self.fail(f"unexpected character {ch!r}")

    def postfix(self, node: Any) -> Any:
        text = self.text
        self.skip()
        if self.i >= len(text) or text[self.i] not in "*+?{":
            return node
        op = text[self.i]
        op_at = self.i
        self.i += 1
        if op == "*":
            node = ("rep", node, 0, None)
        elif op == "+":
            node = ("rep", node, 1, None)
        elif op == "?":
            node = ("rep", node, 0, 1)
        else:
            lo = self.integer()
            hi: int | None = lo
            self.skip()
            if self.i < len(text) and text[self.i] == ",":
                self.i += 1
                self.skip()
                hi = None if self.i < len(text) and text[self.i] == "}" else self.integer()
            self.skip()
            if self.i >= len(text) or text[self.i] != "}":
                self.fail("expected '}' to close the repetition {m,n}")
            self.i += 1
            if lo > MAX_COUNT or (hi is not None and hi > MAX_COUNT):
                self.fail(f"repetition count is too large (at most {MAX_COUNT})", op_at)
            if hi is not None and lo > hi:
                self.fail(f"repetition {{{lo},{hi}}}: the lower bound is larger than the upper bound", op_at)
            node = ("rep", node, lo, hi)
        self.skip()
        if self.i < len(text) and text[self.i] in "*+?{":
            self.fail("two repetition operators in a row; add parentheses, e.g. (x?)*")
        return node

    def integer(self) -> int:
        self.skip()
        start = self.i
        while self.i < len(self.text) and self.text[self.i].isdigit():
            self.i += 1
        if start == self.i:
            self.fail("expected a number in the repetition {m,n} (write {0,n} for 'at most n')")
        return int(self.text[start : self.i])

    def escape(self, table: dict[str, str]) -> str:
        text = self.text
        start = self.i
        self.i += 1  # the backslash
        if self.i >= len(text):
            self.fail("the grammar ends inside an escape sequence", start)
        ch = text[self.i]
        if ch in table:
            self.i += 1
            return table[ch]
        if ch in _HEX_ESCAPES:
            lo, hi = _HEX_ESCAPES[ch]
            j = self.i + 1
            while j < len(text) and j - self.i - 1 < hi and text[j] in string.hexdigits:
                j += 1
            digits = text[self.i + 1 : j]
            if len(digits) < lo:
                self.fail(f"\\{ch} needs {lo} hex digit{'s' if lo > 1 else ''}", start)
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                self.fail(f"\\{ch}{digits} is not a valid character", start)
            self.i = j
            return chr(code)
        self.fail(f"invalid escape sequence \\{ch}", start)

    def string(self) -> str:
        text = self.text
        start = self.i
        self.i += 1
        out = []
        while True:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated string (a string must close on its line)", start)
            ch = text[self.i]
            if ch == '"':
                self.i += 1
                return "".join(out)
            if ch == "\\":
                out.append(self.escape(_SIMPLE_ESCAPES))
            else:
                out.append(ch)
                self.i += 1

    def char_class(self) -> Any:
        text = self.text
        start = self.i
        self.i += 1
        negated = False
        if self.i < len(text) and text[self.i] == "^":
            negated = True
            self.i += 1
        ranges = []

        def one() -> str:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated character class", start)
            if text[self.i] == "\\":
                return self.escape(_CLASS_ESCAPES)
            ch = text[self.i]
            self.i += 1
            return ch

        while True:
            if self.i >= len(text) or text[self.i] == "\n":
                self.fail("unterminated character class", start)
            if text[self.i] == "]":
                self.i += 1
                break
            lo = one()
            if self.i + 1 < len(text) and text[self.i] == "-" and text[self.i + 1] != "]":
                range_at = self.i
                self.i += 1
                hi = one()
                if ord(lo) > ord(hi):
                    self.fail(f"character range {lo!r}-{hi!r} is reversed", range_at)
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        return ("cls", negated, tuple(ranges))

    # ---------------------------------------------------------------- heights

    def compute_heights(self) -> dict[str, float]:
        """Per rule: 1 + the least nesting of rule expansions that derives a finite string (inf: none)."""
        heights = {name: INF for name in self.rules}
        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                h = 1 + self.height(body, heights)
                if h < heights[name]:
                    heights[name] = h
                    changed = True
        return heights

    def height(self, node: Any, heights: dict[str, float]) -> float:
        kind = node[0]
        if kind == "lit":
            return 0
        if kind == "cls":
            return 0 if (node[1] or node[2]) else INF
        if kind == "ref":
            return heights[node[1]]
        if kind == "seq":
            return max((self.height(x, heights) for x in node[1]), default=0)
        if kind == "alt":
            return min(self.height(x, heights) for x in node[1])
        if node[2] == 0:  # rep that may be empty
            return 0
        return self.height(node[1], heights)

    def option_heights(self, alt: Any) -> list[float]:
        """The heights of an alternation node's options (worked out once per node)."""
        heights = self.alt_heights.get(id(alt))
        if heights is None:
            heights = self.alt_heights[id(alt)] = [self.height(x, self.heights) for x in alt[1]]
        return heights
