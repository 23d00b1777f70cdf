"""RegexFullMatch's engine: a pattern in RE2's syntax (a subset, below) compiled at build time to a
Thompson program, and C that runs it over a string with sets of states, one per byte position: time
linear in the string's length (as RE2's), no backtracking, and no library at run time.

Supported: literals (UTF-8), `.`, classes `[...]`/`[^...]` of ASCII members with ranges and the escapes
`\\d \\D \\w \\W \\s \\S`, groups `(...)`, `(?:...)`, `(?P<name>...)`, alternation `|`, the quantifiers
`* + ? {n} {n,} {n,m}` (greedy or lazy: a full match does not depend on it), the anchors `^ $ \\A \\z`
and the ASCII word boundaries `\\b \\B`. As in RE2, `.` and negated classes take one code point, not
`\\n`; `\\w \\d \\s \\b` are ASCII. Refused with PatternError: flags `(?i)`, look-arounds and back
references (RE2 refuses those too), Unicode classes `\\p{...}`, non-ASCII class members, and programs
over MAX_PROGRAM instructions.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_PROGRAM = 4096
MAX_REPEAT = 1000   # RE2's limit on {n,m}

# instructions
BYTE, CLASS, SPLIT, JMP, ASSERT, MATCH = range(6)
BOL, EOL, WORD_BOUNDARY, NOT_WORD_BOUNDARY = range(4)


class PatternError(ValueError):
    pass


def _ascii_set(chars: str) -> set[int]:
    return {ord(c) for c in chars}


_DIGIT = _ascii_set("0123456789")
_WORD = _DIGIT | _ascii_set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_SPACE = _ascii_set("\t\n\f\r ")   # RE2's \s (no \v)
_ALL = set(range(128))


@dataclass(frozen=True)
class CharClass:
    """ASCII members, and whether any non-ASCII code point matches (negated sets)."""
    members: frozenset
    non_ascii: bool

    def negated(self) -> "CharClass":
        return CharClass(frozenset(_ALL - self.members), not self.non_ascii)


_CLASS_ESCAPES = {"d": CharClass(frozenset(_DIGIT), False), "w": CharClass(frozenset(_WORD), False),
                  "s": CharClass(frozenset(_SPACE), False)}
_LITERAL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


class _Parser:
    """Recursive descent: alternation > concatenation > repetition > atom. Nodes are tuples:
    ("bytes", b), ("class", CharClass), ("cat", [..]), ("alt", [..]), ("repeat", node, lo, hi|None),
    ("assert", kind), ("empty",)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def parse(self):
        node = self.alternation()
        if self.i < len(self.p):
            raise PatternError(f"unmatched ')' at offset {self.i}")
        return node

    def peek(self):
        return self.p[self.i] if self.i < len(self.p) else None

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else ("alt", options)

    def concatenation(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            items.append(self.repetition())
        return ("cat", items) if items else ("empty",)

    def repetition(self):
        node = self.atom()
        while self.peek() is not None and self.peek() in "*+?{":
            c = self.peek()
            if c == "{":
                bounds = self.counted()
                if bounds is None:   # RE2 takes a '{' that starts no repetition as a literal
                    break
                lo, hi = bounds
            else:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if node[0] == "assert":
                raise PatternError("a quantifier after an anchor or \\b")
            if self.peek() == "?":   # lazy: the same full matches
                self.i += 1
            if self.peek() == "+":
                raise PatternError("possessive quantifiers are not RE2 syntax")
            node = ("repeat", node, lo, hi)
        return node

    def counted(self):
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        text = self.p[self.i + 1:end]
        lo_text, comma, hi_text = text.partition(",")
        if not lo_text.isdigit() or (hi_text and not hi_text.isdigit()):
            return None
        lo = int(lo_text)
        hi = lo if not comma else (int(hi_text) if hi_text else None)
        if lo > MAX_REPEAT or (hi is not None and (hi > MAX_REPEAT or hi < lo)):
            raise PatternError(f"bad repetition {{{text}}} (at most {MAX_REPEAT}, and min <= max)")
        self.i = end + 1
        return lo, hi

    def atom(self):
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) or self.p.startswith("?<", self.i):
                end = self.p.find(">", self.i)
                if end < 0:
                    raise PatternError("unterminated group name")
                self.i = end + 1
            elif self.peek() == "?":
                raise PatternError(f"'(?{self.p[self.i + 1:self.i + 2]}' (flags, look-arounds) is not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise PatternError("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("class", self.char_class())
        if c == ".":
            return ("class", CharClass(frozenset(_ALL - {10}), True))
        if c == "^":
            return ("assert", BOL)
        if c == "$":
            return ("assert", EOL)
        if c in "*+?":
            raise PatternError(f"nothing to repeat before '{c}' at offset {self.i - 1}")
        if c == ")":
            raise PatternError(f"unmatched ')' at offset {self.i - 1}")
        if c == "\\":
            return self.escape(in_class=False)
        return ("bytes", c.encode("utf-8"))

    def escape(self, in_class: bool):
        if self.i >= len(self.p):
            raise PatternError("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            cls = _CLASS_ESCAPES[c.lower()]
            return ("class", cls.negated() if c.isupper() else cls)
        if c in _LITERAL_ESCAPES:
            return ("bytes", _LITERAL_ESCAPES[c].encode())
        if c == "x":
            digits = self.p[self.i:self.i + 2]
            if len(digits) != 2 or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise PatternError("\\x takes two hex digits here")
            self.i += 2
            return ("bytes", chr(int(digits, 16)).encode("utf-8"))
        if not in_class:
            if c == "b":
                return ("assert", WORD_BOUNDARY)
            if c == "B":
                return ("assert", NOT_WORD_BOUNDARY)
            if c == "A":
                return ("assert", BOL)
            if c == "z":
                return ("assert", EOL)
        if c.isalnum():
            raise PatternError(f"the escape \\{c} is not supported (back references, \\p classes, \\Q...)")
        return ("bytes", c.encode("utf-8"))

    def char_class(self) -> CharClass:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        members, non_ascii, first = set(), False, True
        while True:
            c = self.peek()
            if c is None:
                raise PatternError("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_member()
            if isinstance(lo, CharClass):
                members |= lo.members
                non_ascii |= lo.non_ascii
                continue
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_member()
                if isinstance(hi, CharClass) or hi < lo:
                    raise PatternError("bad range in a character class")
                members |= set(range(lo, hi + 1))
            else:
                members.add(lo)
        cls = CharClass(frozenset(members), non_ascii)
        return cls.negated() if negate else cls

    def class_member(self):
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            node = self.escape(in_class=True)
            if node[0] == "class":
                return node[1]
            c = node[1].decode("utf-8")
        if c == "[" and self.peek() == ":":
            raise PatternError("POSIX classes [:name:] are not supported")
        if ord(c) >= 128:
            raise PatternError(f"the non-ASCII character {c!r} in a character class is not supported")
        return ord(c)


def compile_pattern(pattern: str) -> tuple[list[tuple[int, int, int]], list[CharClass]]:
    """The program: (op, a, b) instructions and the classes CLASS instructions index."""
    tree = _Parser(pattern).parse()
    program, classes = [], []

    def emit(op, a=0, b=0) -> int:
        program.append([op, a, b])
        if len(program) > MAX_PROGRAM:
            raise PatternError(f"the pattern compiles to more than {MAX_PROGRAM} instructions")
        return len(program) - 1

    def gen(node):
        kind = node[0]
        if kind == "bytes":
            for byte in node[1]:
                emit(BYTE, byte)
        elif kind == "class":
            if node[1] not in classes:
                classes.append(node[1])
            emit(CLASS, classes.index(node[1]))
        elif kind == "assert":
            emit(ASSERT, node[1])
        elif kind == "cat":
            for item in node[1]:
                gen(item)
        elif kind == "alt":
            jumps = []
            for option in node[1][:-1]:
                split = emit(SPLIT)
                program[split][1] = len(program)
                gen(option)
                jumps.append(emit(JMP))
                program[split][2] = len(program)
            gen(node[1][-1])
            for j in jumps:
                program[j][1] = len(program)
        elif kind == "repeat":
            _, inner, lo, hi = node
            for _ in range(lo):
                gen(inner)
            if hi is None:   # L: split body, end; body; jmp L
                top = emit(SPLIT)
                program[top][1] = len(program)
                gen(inner)
                emit(JMP, top)
                program[top][2] = len(program)
            else:   # (inner (inner (...)?)?)?
                splits = []
                for _ in range(hi - lo):
                    split = emit(SPLIT)
                    program[split][1] = len(program)
                    splits.append(split)
                    gen(inner)
                for split in splits:
                    program[split][2] = len(program)
        # "empty": nothing
    gen(tree)
    emit(MATCH)
    return [tuple(i) for i in program], classes


def c_matcher(compiled, n: int) -> list[str]:
    """C statements: y[i] = whether x[i] fully matches, for i < n (x: const char* const*, y: bytes).
    The states reachable at each byte position are a bitset; a state is added with its closure (splits,
    jumps and the anchors true at that position), then each consuming state at position `pos` adds
    its successor at the position after the byte or code point it takes."""
    program, classes = compiled
    size = len(program)
    words = (size + 63) // 64
    ops = ", ".join(f"{{{op}, {a}, {b}}}" for op, a, b in program)
    bitmaps = []
    for cls in classes:
        bits = [0, 0, 0, 0]
        for m in cls.members:
            bits[m // 32] |= 1 << (m % 32)
        bitmaps.append("{" + ", ".join(f"0x{b:08x}u" for b in bits) + f", {int(cls.non_ascii)}u}}")
    return _matcher(size, words, ops, bitmaps, n, classes)


def _closure(pos: str, here: str) -> list[str]:
    """C: follow the splits, jumps and true anchors from the states on `stack`, adding to `here`."""
    return [
        "        while (top > 0) {",
        "            const int q = stack[--top];",
        "            const int op = prog[q][0];",
        "            int to[2], m = 0;",
        "            if (op == 2) { to[m++] = prog[q][1]; to[m++] = prog[q][2]; }",
        "            else if (op == 3) to[m++] = prog[q][1];",
        "            else if (op == 4) {",
        f"                const int before = {pos} > 0 && IS_WORD(s[{pos} - 1]), after = {pos} < len && IS_WORD(s[{pos}]);",
        "                const int kind = prog[q][1];",
        f"                const int ok = kind == 0 ? {pos} == 0 : kind == 1 ? {pos} == len : kind == 2 ? before != after : before == after;",
        "                if (ok) to[m++] = q + 1;",
        "            }",
        "            for (int j = 0; j < m; j++) {",
        "                const int t = to[j];",
        f"                if ({here}[t >> 6] >> (t & 63) & 1) continue;",
        f"                {here}[t >> 6] |= 1ull << (t & 63);",
        "                stack[top++] = t;",
        "            }",
        "        }",
    ]


def _matcher(size, words, ops, bitmaps, n, classes) -> list[str]:
    return [
        f"    static const int32_t prog[{size}][3] = {{{ops}}};",
        f"    static const uint32_t cls[{max(1, len(classes))}][5] = {{{', '.join(bitmaps) or '{0}'}}};",
        f"    int32_t stack[{size}];",
        "    uint64_t* sets = NULL;",
        "    size_t capacity = 0;",
        "#define IS_WORD(c) (((c) >= '0' && (c) <= '9') || ((c) >= 'a' && (c) <= 'z') || ((c) >= 'A' && (c) <= 'Z') || (c) == '_')",
        f"    for (int64_t i = 0; i < {n}; i++) {{",
        "        const unsigned char* s = (const unsigned char*)x[i];",
        "        const size_t len = strlen((const char*)s);",
        f"        const size_t need = (len + 1) * {words};",
        "        if (need > capacity) {",
        "            free(sets);",
        "            capacity = need > 2 * capacity ? need : 2 * capacity;",
        "            sets = (uint64_t*)aligned_alloc(64, (capacity * 8 + 63) / 64 * 64);",
        "            if (!sets) { S->code = 3; snprintf(S->message, sizeof S->message, \"out of memory for RegexFullMatch\"); return; }",
        "        }",
        "        memset(sets, 0, need * 8);",
        "        {",
        "        const size_t at0 = 0;",
        "        uint64_t* start = sets;",
        "        int top = 0;",
        "        start[0] |= 1; stack[top++] = 0;",
        *_closure("at0", "start"),
        "        }",
        "        for (size_t pos = 0; pos < len; pos++) {",
        f"            const uint64_t* here = sets + pos * {words};",
        f"            for (int w = 0; w < {words}; w++)",
        "            for (uint64_t bits = here[w]; bits; bits &= bits - 1) {   /* the active states only */",
        "                const int pc = w * 64 + __builtin_ctzll(bits);",
        "                size_t step = 0;",
        "                if (prog[pc][0] == 0) step = s[pos] == (unsigned)prog[pc][1];",
        "                else if (prog[pc][0] == 1) {",
        "                    const unsigned c = s[pos];",
        "                    const uint32_t* k = cls[prog[pc][1]];",
        "                    if (c < 128) step = (k[c >> 5] >> (c & 31)) & 1;",
        "                    else if (k[4]) {",
        "                        step = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;",
        "                        if (pos + step > len) step = len - pos;",
        "                    }",
        "                }",
        "                if (!step) continue;",
        "                const size_t at = pos + step;",
        f"                uint64_t* there = sets + at * {words};",
        "                const int next = pc + 1;",
        "                if (there[next >> 6] >> (next & 63) & 1) continue;",
        "                int top = 0;",
        "                there[next >> 6] |= 1ull << (next & 63);",
        "                stack[top++] = next;",
        *_closure("at", "there"),
        "            }",
        "        }",
        f"        y[i] = (sets[len * {words} + ({size - 1} >> 6)] >> ({size - 1} & 63)) & 1;",
        "    }",
        "    free(sets);",
        "#undef IS_WORD",
    ]
