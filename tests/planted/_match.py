"""How a planted bug's edits are found and made (tests/planted/__init__.py says what and why): sources as streams of
tokens, the functions they define, a pattern matched inside one, a replacement spliced where it matched."""

from __future__ import annotations

import ast
import builtins
import functools
import io
import keyword
import re
import tokenize
from dataclasses import dataclass

LAYOUT = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
ENDS = {tokenize.NEWLINE, tokenize.ENDMARKER}  # where a statement ends: whether parentheses wrap a whole expression
WRAPPED_AFTER = {"return", "if", "elif", "while", "in", "assert", "del", "with", "yield", "await"}
ASSIGN = re.compile(r"(?:[-+*/%&|^@]|//|<<|>>|\*\*)?=")  # =, +=, ...: what a formatter wraps the right side of
OPENING, CLOSING = {"(", "[", "{"}, {")", "]", "}"}
C_TOKEN = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|\.?\d(?:[eEpP][-+]|[\w.])*"""
                     r"""|\w+|::|->|<<=?|>>=?|&&|\|\||\+\+|--|[-+*/%&|^!=<>]=|\S""", re.DOTALL)
C_NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "defined"}
C_QUALIFIERS = {"const", "noexcept", "override", "final"}
BLOCKS = (ast.stmt, ast.excepthandler, getattr(ast, "match_case", ast.stmt))  # what a def can be inside


class Stale(Exception):
    """A planted bug that no longer applies to the code; the message says why."""


@dataclass(frozen=True)
class Token:
    """A token: its text, where it starts and ends (character offsets), and its kind: "code", "comment" or
    "optional" (a trailing comma before a closing bracket, a wrapping parenthesis: skipped when matching)."""

    text: str
    start: int
    end: int
    kind: str = "code"


def planted(text: str, path: str, function: str | None, edits) -> str:
    """`text`, the source of `path`, with `edits` (pattern, replacement) made in order inside `function` (None: the
    top level); raises Stale, saying why, where they no longer apply."""
    python, original = path.endswith(".py"), text
    spans = scopes(text, function, path)
    for i, (old, new) in enumerate(edits, 1):
        source, pattern = lex(text, python), [t for t in lex(old, python, True) if t.kind != "optional"]
        found = matches(source, pattern, spans)
        if len(found) != 1:
            raise Stale(missed(i, text, source, pattern, found, function, path))
        if python and (names := unknown(old, new, source)):
            raise Stale(f"edit {i} reads {', '.join(names)}, which {path} no longer has")
        edited = splice(text, source, found[0], old, new, python)
        at, by = source[found[0][0]].start, len(edited) - len(text)
        spans = [(a + by * (a > at), b + by * (b > at)) for a, b in spans]
        text = edited
    if text == original:
        raise Stale("the edits change nothing")
    check(text, path, python)
    return text


def missed(i: int, text: str, source: list[Token], pattern: list[Token], found: list[list[int]],
           function: str | None, path: str) -> str:
    """Why edit `i`, whose pattern matched at each of `found`, was not made: where it matched, or where in the
    file it is now, if it is there once."""
    why = f"edit {i} matches {len(found)} times in {function or 'the top level'} of {path}"
    if found:
        return why + f" (lines {', '.join(str(line(text, source[at[0]].start)) for at in found)})"
    elsewhere = matches(source, pattern, [(0, len(text))])
    if len(elsewhere) != 1:
        return why
    at = source[elsewhere[0][0]].start
    inner = enclosing(text, path, at, at + 1)
    return why if inner == function else why + f" (it is in {inner or 'the top level'} now, line {line(text, at)})"


def line(text: str, at: int) -> int:
    """The line number of character `at` of `text`."""
    return text.count("\n", 0, at) + 1


@functools.lru_cache(maxsize=64)  # a file's entries lex it alike (the list is shared: never changed)
def lex(text: str, python: bool, fragment: bool = False) -> list[Token]:
    """The tokens of `text`, layout left out; `fragment`: a piece of a source (which may leave a bracket open)."""
    found = python_tokens(text, fragment) if python else c_tokens(text)
    partner = pairs(found)
    return [Token(t.text, t.start, t.end, "optional") if t.text == "," and trailing(found, partner, i) else t
            for i, t in enumerate(found)]


def trailing(found: list[Token], partner: dict[int, int], i: int) -> bool:
    """Whether the comma at `i` is one a formatter may add: the last thing in its brackets (comments aside), and
    not what makes them a tuple of one, `(a,)`, or a subscript by one, `x[a,]`."""
    close = i + 1
    while close < len(found) and found[close].kind == "comment":
        close += 1
    if close == len(found) or found[close].text not in CLOSING:
        return False
    if close not in partner or found[close].text == "}":
        return True
    k = opening = partner[close]
    ahead = found[opening - 1].text if opening else ""  # a name, a call's result, a string: a call or a subscript
    applied = ahead in CLOSING or ahead[-1:] in ("'", '"') or ahead.isidentifier() and not keyword.iskeyword(ahead)
    while k + 1 < i:
        k = partner.get(k + 1, k + 1) if found[k + 1].text in OPENING else k + 1
        if found[k].text == ",":
            return True
    return (found[close].text == ")") == applied


def python_tokens(text: str, fragment: bool) -> list[Token]:
    """Python's tokens of `text` (comments included, the parentheses that wrap a whole expression optional); a
    fragment whose indentation does not add up is read with its lines' indentation taken away."""
    lines = io.StringIO(text).readlines()
    try:
        return unwrapped(python_lines(lines, [0] * len(lines), fragment))
    except IndentationError:
        if not fragment:
            raise
    cut = [len(line) - len(line.lstrip(" \t")) for line in lines]
    return unwrapped(python_lines([line[n:] for line, n in zip(lines, cut)], cut, fragment))


def python_lines(lines: list[str], cut: list[int], fragment: bool) -> list[Token]:
    """The tokens of `lines`, each of which had `cut` characters taken from its start (offsets are the text's);
    the statements' ends as empty tokens."""
    starts = [0]
    for line, n in zip(lines, cut):
        starts.append(starts[-1] + n + len(line))
    at = [start + n for start, n in zip(starts, cut + [0])]  # where each line's kept characters start
    found = []
    try:
        for t in tokenize.generate_tokens(iter(lines).__next__):  # StopIteration: the end
            if t.type in ENDS or t.type not in LAYOUT and not (t.type == tokenize.ERRORTOKEN and t.string.isspace()):
                kind = "comment" if t.type == tokenize.COMMENT else "code"
                found.append(Token("" if t.type in ENDS else t.string, at[t.start[0] - 1] + t.start[1],
                                   at[t.end[0] - 1] + t.end[1], kind))
    except tokenize.TokenError:
        if not fragment:
            raise
    return found


def unwrapped(tokens: list[Token]) -> list[Token]:
    """`tokens` (with "" where a statement ends) without those ends, the parentheses that wrap the whole of an
    expression after `=`, `return`, `if`, ... made optional: the ones a formatter adds to break a long line."""
    wrapping, partner = set(), pairs(tokens)
    for i, token in enumerate(tokens):
        if token.text == "(" and i and (tokens[i - 1].text in WRAPPED_AFTER or ASSIGN.fullmatch(tokens[i - 1].text)):
            close = partner.get(i)
            after = close + 1 if close is not None else len(tokens)
            while after < len(tokens) and tokens[after].kind == "comment":
                after += 1
            if after < len(tokens) and tokens[after].text in ("", ":"):
                wrapping |= {i, close}
    return [Token(t.text, t.start, t.end, "optional") if i in wrapping else t
            for i, t in enumerate(tokens) if t.text or t.kind != "code"]


def c_tokens(text: str) -> list[Token]:
    """C++'s tokens of `text`, roughly (names, numbers, strings, operators and comments): enough to find an edit."""
    return [Token(m.group(), m.start(), m.end(), "comment" if m.group().startswith(("//", "/*")) else "code")
            for m in C_TOKEN.finditer(text)]


def pairs(tokens: list[Token]) -> dict[int, int]:
    """The index of each bracket's partner, for each bracket that has one (both ways)."""
    partner, open_ = {}, []
    for i, token in enumerate(tokens):
        if token.text in OPENING and token.kind != "comment":
            open_.append(i)
        elif token.text in CLOSING and open_ and token.kind != "comment":
            partner[i] = open_.pop()
            partner[partner[i]] = i
    return partner


def scopes(text: str, function: str | None, path: str) -> list[tuple[int, int]]:
    """The spans (character offsets) of `function`'s definitions in `text`, the source of `path` (the whole text
    for None); raises Stale where there is none."""
    if function is None:
        return [(0, len(text))]
    spans = [(start, end) for name, start, end in definitions(text, path.endswith(".py")) if name == function]
    if not spans:
        raise Stale(f"no function {function} in {path}")
    return spans


@functools.lru_cache(maxsize=64)
def definitions(text: str, python: bool) -> list[tuple[str, int, int]]:
    """(qualified name, start, end) of every function and class defined in `text`."""
    if not python:
        return c_functions(text)
    lines = io.StringIO(text).readlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    try:
        todo = [(node, "") for node in ast.parse(text).body]
    except SyntaxError as error:
        raise Stale(f"the file does not parse: {error}") from None
    found = []
    while todo:
        node, outer = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = outer + node.name
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            end = starts[node.end_lineno - 1] + len(lines[node.end_lineno - 1].rstrip("\r\n"))  # a comment on it too
            found.append((name, starts[first - 1], end))
            todo += [(child, name + ".") for child in ast.iter_child_nodes(node) if isinstance(child, BLOCKS)]
        else:
            todo += [(child, outer) for child in ast.iter_child_nodes(node) if isinstance(child, BLOCKS)]
    return found


def c_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of every C++ function body in `text`: a name, its parenthesised parameters, maybe
    qualifiers, then a braced body (from the name's line to the closing brace)."""
    tokens = [t for t in c_tokens(text) if t.kind != "comment"]
    partner, found = pairs(tokens), []
    for i, token in enumerate(tokens[:-1]):
        if not token.text.isidentifier() or token.text in C_NOT_FUNCTIONS or tokens[i + 1].text != "(":
            continue
        after = partner.get(i + 1, len(tokens)) + 1
        while after < len(tokens) and tokens[after].text in C_QUALIFIERS:
            after += 1
        if after < len(tokens) and tokens[after].text == "{" and after in partner:
            found.append((token.text, text.rfind("\n", 0, token.start) + 1, tokens[partner[after]].end))
    return found


def enclosing(text: str, path: str, start: int, end: int) -> str | None:
    """The qualified name of the innermost function (or class) of `text` (the source of `path`) that holds the
    characters `start`..`end`; None: the top level."""
    inside = [(b - a, name) for name, a, b in definitions(text, path.endswith(".py")) if a <= start and end <= b]
    return min(inside)[1] if inside else None


def matches(source: list[Token], pattern: list[Token], spans: list[tuple[int, int]]) -> list[list[int]]:
    """Each place inside `spans` where `source` holds `pattern`, as the index in `source` of each pattern token."""
    found = []
    for i, first in enumerate(source):
        if pattern and first.kind == pattern[0].kind and any(a <= first.start < b for a, b in spans):
            at = match_at(source, i, pattern)
            if at and any(a <= first.start and source[at[-1]].end <= b for a, b in spans):
                found.append(at)
    return found


def match_at(source: list[Token], i: int, pattern: list[Token]) -> list[int] | None:
    """The indices in `source` of `pattern`'s tokens matched from token `i` on, or None: the source's optional
    tokens and comments (where the pattern has none) skipped; a comment that ends the pattern may begin one."""
    at = []
    for j, want in enumerate(pattern):
        while i < len(source) and (source[i].kind == "optional" or source[i].kind == "comment" != want.kind):
            i += 1
        if i == len(source) or source[i].kind != want.kind:
            return None
        got, text = " ".join(source[i].text.split()), " ".join(want.text.split())
        if not (got == text or want.kind == "comment" and j == len(pattern) - 1 and got.startswith(text)):
            return None
        at.append(i)
        i += 1
    return at


def splice(text: str, source: list[Token], at: list[int], old: str, new: str, python: bool) -> str:
    """`text` with `new` in place of `old`, whose pattern tokens were found at `source[at[...]]`: `old`'s characters
    where they are there as written; else the tokens where `old` and `new` differ (a wrapping pair of parentheses
    cut in two by them dropped)."""
    before, after = lex(old, python, True), lex(new, python, True)
    where = {}  # old token -> its source token
    for k in (k for k, t in enumerate(before) if t.kind != "optional"):
        where[k] = at[len(where)]
    first = source[at[0]].start - before[min(where)].start
    if first >= 0 and text[first:first + len(old)] == old:
        return text[:first] + new + text[first + len(old):]
    p = 0
    while p < min(len(before), len(after)) and before[p].text == after[p].text:
        p += 1
    q, r = len(before), len(after)
    while q > p and r > p and before[q - 1].text == after[r - 1].text:
        q, r = q - 1, r - 1
    start, end = bounds(source, where, p, q)
    if p == r:
        body = ""
    elif p == q:  # an insertion, with the whitespace that comes before (or after) it in `new`
        body = new[after[p - 1].end:after[r - 1].end] if p else new[after[0].start:after[r].start]
    else:
        body = new[after[p].start:after[r - 1].end]
    edited = text[:start] + reindented(body, text, source, where, before, old) + text[end:]
    for a, b in sorted(orphans(source, start, end), reverse=True):
        shift = (len(edited) - len(text)) * (a >= end)
        edited = edited[:a + shift] + edited[b + shift:]
    return edited


def bounds(source: list[Token], where: dict[int, int], p: int, q: int) -> tuple[int, int]:
    """The characters of the source that old tokens p..q-1 stand for (an empty span where p == q: inside the
    parentheses that wrap what follows the token before)."""
    matched = sorted(where)
    prior, later = [k for k in matched if k < p], [k for k in matched if k >= q]
    opened = inside(source, where[prior[-1]]) if prior else source[where[matched[0]]].start
    closed = source[where[later[0]]].start if later else source[where[matched[-1]]].end
    if p == q:
        return opened, opened
    return (source[where[p]].start if p in where else opened, source[where[q - 1]].end if q - 1 in where else closed)


def inside(source: list[Token], i: int) -> int:
    """Where source token `i` ends, or the wrapping parentheses that open right after it do."""
    at = source[i].end
    for token in source[i + 1:]:
        if token.kind == "optional" and token.text == "(":
            at = token.end
        elif token.kind != "comment":
            break
    return at


def orphans(source: list[Token], start: int, end: int) -> list[tuple[int, int]]:
    """The characters to take out besides `start`..`end`: each wrapping parenthesis whose partner is inside it (a
    closing one with the trailing comma before it)."""
    found, partner = [], pairs(source)
    for i, token in enumerate(source):
        if token.kind == "optional" and token.text == "(" and (close := partner.get(i)) is not None:
            if start <= token.start < end <= source[close].start:
                comma = [t for t in source[i:close] if t.kind != "comment"][-1]
                found.append((comma.start if comma.text == "," and comma.start >= end else source[close].start,
                              source[close].end))
            elif token.start < start <= source[close].start < end:
                found.append((token.start, token.end))
    return found


def reindented(body: str, text: str, source: list[Token], where: dict[int, int], before: list[Token],
               old: str) -> str:
    """`body` with its lines after the first re-indented by the change, if any, of the first line of `old` that
    begins with a token known in both (that token's indentation in `old` and in `text`)."""
    for k, i in where.items():
        written = old[:before[k].start].rpartition("\n")
        now = text[text.rfind("\n", 0, source[i].start) + 1:source[i].start]
        if written[2].strip() or now.strip() or not (written[1] or written[2]):
            continue
        if written[2] == now:
            return body
        return re.sub(rf"\n{re.escape(written[2])}", lambda _: "\n" + now, body)
    return body


def unknown(old: str, new: str, source: list[Token]) -> list[str]:
    """The names `new` reads (not an attribute, not a name it binds) that neither `old` nor `source` (the file's
    tokens before the edit) holds, nor Python's builtins: a local renamed since the entry was written."""
    tokens = lex(new, True, True)
    known = {t.text for t in source + lex(old, True, True)} | set(dir(builtins)) | bound(tokens)
    return [t.text for i, t in enumerate(tokens) if t.kind == "code" and t.text.isidentifier() and t.text not in known
            and not keyword.iskeyword(t.text) and not (i and tokens[i - 1].text == ".")]


def bound(tokens: list[Token]) -> set[str]:
    """The names `tokens` bind: defined (def, class, as, import), assigned (=, :=, a keyword argument), looped over
    (for ... in) or taken as a lambda's parameters."""
    names, until = set(), None
    for i, token in enumerate(tokens):
        if until and token.text == until:
            until = None
        elif token.text in ("for", "lambda"):
            until = "in" if token.text == "for" else ":"
        elif until or i and tokens[i - 1].text in ("def", "class", "as", "import"):
            names.add(token.text)
        elif i + 1 < len(tokens) and tokens[i + 1].text in ("=", ":="):
            names.add(token.text)
    return names


def check(text: str, path: str, python: bool) -> None:
    """Raises Stale where the edited `text` does not compile (a C++ file: where its brackets do not balance)."""
    if python:
        try:
            compile(text, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as error:
            raise Stale(f"the edited file does not compile: {error}") from None
        return
    depth = 0
    for token in c_tokens(text):
        depth += (token.text in OPENING) - (token.text in CLOSING)
        if depth < 0:
            break
    if depth:
        raise Stale("the edited file's brackets do not balance")
