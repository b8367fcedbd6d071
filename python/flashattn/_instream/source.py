"""The kernel sources of the in-stream paths, generated from the shipped
shaders/*.metal: one source of truth, never a second copy of a kernel.

For each kernel the metal engine's plan names (``flash_fwd_f16_hd64``), this
finds the template it instantiates in the .metal files (their explicit
instantiations, macros expanded) and writes:

- for ``mx.fast.metal_kernel`` (:func:`ShaderSet.mlx_kernel`): a header (the
  .metal file with its #includes inlined, every kernel definition and
  instantiation removed) and a body: a prologue that binds the kernel's
  parameter names to the arguments of the signature MLX writes (inputs and
  outputs by name, builtins by attribute name), then the kernel template's
  body verbatim, its template parameters pinned to the instantiation's
  arguments. MLX passes inputs as `device` pointers, so the kernel's
  `constant X&` parameters (FlashParams, FlashScoreParams) are read from a
  byte buffer through `device const X&`, everywhere in the text;
- for ``torch.mps.compile_shader`` (:func:`ShaderSet.torch_source`): the
  same inlined file with that one kernel template unchanged and one explicit
  instantiation of it, as MLX instantiates its templates.

Function constants (``[[function_constant]]``) become program-scope
`constant constexpr` values (:func:`constants_block`): neither MLX's nor
torch's JIT path specialises them. The block comes first and defines
FA_FUNCTION_CONSTANT only where the includer has not, so metal-sim, whose
<metal_stdlib> defines it, compiles the very same text with the launch's
values set at run time, as it does the shipped .metal files.

Standard library only, and no imports from flashattn: the build runs this
file by path (cpp/sim/generate_instream.py) before the package exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The constants block's first and last lines (text_key removes what lies
# between them, inclusive: metal-sim compiles the rest once for every value).
CONSTANTS_BEGIN = "// flashattn: function constants (FA_FUNCTION_CONSTANT by index)\n"
CONSTANTS_END = "// flashattn: end of function constants\n"

# The element types of the kernels' pointer parameters, by C name, as MLX
# names the dtype of an array bound there (mx.<name>).
C_TO_DTYPE = {
    "float": "float32", "half": "float16", "bfloat": "bfloat16",
    "uchar": "uint8", "uint8_t": "uint8", "char": "int8", "int": "int32", "uint": "uint32",
    "short": "int16", "ushort": "uint16", "bool": "bool",
}

# The builtins a kernel may take, as MSL names the attribute.
BUILTINS = (
    "threadgroup_position_in_grid", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
    "thread_position_in_grid", "thread_position_in_threadgroup", "threads_per_threadgroup",
    "threadgroups_per_grid", "threads_per_grid", "simdgroups_per_threadgroup",
    "threads_per_simdgroup", "thread_execution_width", "quadgroup_index_in_threadgroup",
    "thread_index_in_quadgroup", "quadgroups_per_threadgroup",
)


class SourceError(ValueError):
    """The shaders do not have the shape this generator reads."""


@dataclass(frozen=True)
class Param:
    """One parameter of a kernel: `decl name [[attr]]`."""

    decl: str                 # its type as written, e.g. "device const T*", "constant FlashParams&"
    name: str
    buffer: int | None        # [[buffer(n)]]
    builtin: str | None       # [[threadgroup_position_in_grid]] and the like

    @property
    def by_value(self) -> bool:  # constant X&: a struct passed by value (setBytes)
        return self.buffer is not None and self.decl.endswith("&")

    @property
    def is_output(self) -> bool:  # a device pointer the kernel writes
        words = re.findall(r"\w+", self.decl)
        return self.buffer is not None and "device" in words and "const" not in words

    def element(self, bindings: dict[str, str]) -> str:
        """The C element type it points at (or the struct's name), template
        parameters replaced by `bindings`."""
        words = [w for w in re.findall(r"\w+", self.decl)
                 if w not in ("device", "constant", "const", "threadgroup", "thread")]
        if len(words) != 1:
            raise SourceError(f"parameter {self.name}: cannot read the element type of "
                              f"'{self.decl}'")
        return bindings.get(words[0], words[0])


@dataclass(frozen=True)
class KernelTemplate:
    """A kernel definition in a .metal file (templated or not)."""

    name: str
    template_params: tuple[tuple[str, str], ...]  # (type or "typename", name)
    params: tuple[Param, ...]
    body: str                                     # between its braces
    definition: str                               # the whole definition, as written
    file: str


@dataclass(frozen=True)
class Instance:
    """An explicit instantiation: a kernel's host name and template arguments."""

    host_name: str
    kernel: KernelTemplate
    args: tuple[str, ...]

    def bindings(self) -> dict[str, str]:
        return {name: arg for (_, name), arg in zip(self.kernel.template_params, self.args)}

    def dtype(self, param: Param) -> str:
        """The MLX dtype an array bound to `param` has: its element type; a
        struct passed by value travels as bytes."""
        if param.by_value:
            return "uint8"
        element = param.element(self.bindings())
        if element not in C_TO_DTYPE:
            raise SourceError(f"{self.host_name}: parameter {param.name} has element type "
                              f"'{element}', which no array dtype names")
        return C_TO_DTYPE[element]


@dataclass(frozen=True)
class MlxKernel:
    """What ``mx.fast.metal_kernel`` is given for one kernel instance."""

    name: str                          # spells the kernel and its specialisation
    header: str                        # constants block + the inlined file, kernels removed
    source: str                        # prologue + the template's body
    inputs: tuple[tuple[str, Param], ...]   # (MLX input name, the kernel parameter), buffer order
    outputs: tuple[tuple[str, Param], ...]
    instance: Instance


# ---- Text handling: includes, comments, balanced brackets.

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*\n?', re.M)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*\n?", re.M)


def inline_includes(name: str, files: dict[str, str], seen: set[str] | None = None) -> str:
    """`name`'s text with each quoted #include replaced by that file's text,
    once per file (every shader header is #pragma once); <...> includes stay."""
    seen = set() if seen is None else seen
    seen.add(name)
    if name not in files:
        raise SourceError(f"#include \"{name}\": no such file among the shaders "
                          f"({', '.join(sorted(files))})")
    text = _PRAGMA_ONCE.sub("", files[name])

    def include(m: re.Match) -> str:
        target = m.group(1)
        if target in seen:
            return ""
        return inline_includes(target, files, seen) + "\n"

    return _INCLUDE.sub(include, text)


def strip_comments(text: str) -> str:
    """C and C++ comments removed (a block comment's newlines kept), strings
    and character literals left alone; trailing spaces dropped."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise SourceError("unterminated /* comment")
            out.append("\n" * text.count("\n", i, j))
            i = j + 2
        else:
            out.append(c)
            i += 1
    return re.sub(r"[ \t]+\n", "\n", "".join(out))


def _match(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise SourceError(f"unbalanced '{open_}' at offset {start}")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside (), <>, [] and {}."""
    parts, depth, last = [], 0, 0
    for i, c in enumerate(text):
        if c in "(<[{":
            depth += 1
        elif c in ")>]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


# ---- Kernel definitions.

# A kernel definition: an optional template head, an optional
# FA_MAX_THREADS(n) (its declared threadgroup size: kept in the torch
# source, which compiles the template unchanged; MLX's metal_kernel writes
# its own signature, which cannot carry it), then `kernel void name(`.
_KERNEL = re.compile(r"(?:\btemplate\s*<(?P<tparams>[^<>]*)>\s*)?"
                     r"(?:\bFA_MAX_THREADS\s*\([^()]*\)\s*)?"
                     r"(?:\[\[\s*kernel\s*\]\]|\bkernel)\s+void\s+(?P<name>\w+)\s*\(")
_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")


def _parse_param(text: str, kernel: str) -> Param:
    attrs = _ATTR.findall(text)
    decl = _ATTR.sub("", text).strip()
    m = re.match(r"(.*?)(\w+)$", decl, re.S)
    if not m or not m.group(1).strip():
        raise SourceError(f"kernel {kernel}: cannot read parameter '{text}'")
    buffer = builtin = None
    for attr, index in attrs:
        if attr == "buffer":
            buffer = int(index)
        elif attr in BUILTINS:
            builtin = attr
        else:
            raise SourceError(f"kernel {kernel}: parameter '{text}' has attribute [[{attr}]], "
                              "which the in-stream paths do not bind")
    if (buffer is None) == (builtin is None):
        raise SourceError(f"kernel {kernel}: parameter '{text}' is neither a buffer nor a builtin")
    return Param(" ".join(m.group(1).split()), m.group(2), buffer, builtin)


def find_kernels(text: str, file: str) -> list[tuple[KernelTemplate, int, int]]:
    """Every kernel definition in `text` with its span (a kernel named in an
    explicit instantiation, `flash_fwd<HD, T>(`, is not a definition)."""
    found = []
    for m in _KERNEL.finditer(text):
        open_paren = m.end() - 1
        close = _match(text, open_paren, "(", ")")
        rest = text[close:].lstrip()
        if not rest.startswith("{"):
            continue  # a declaration
        brace = close + (len(text) - close - len(rest))
        end = _match(text, brace, "{", "}")
        tparams = []
        for p in _split_top(m.group("tparams") or ""):
            words = p.split()
            kind = "typename" if words[0] in ("class", "typename") else " ".join(words[:-1])
            tparams.append((kind, words[-1]))
        params = tuple(_parse_param(p, m.group("name"))
                       for p in _split_top(text[open_paren + 1:close - 1]))
        buffers = [p.buffer for p in params if p.buffer is not None]
        if buffers != list(range(len(buffers))):
            raise SourceError(f"kernel {m.group('name')}: buffer indices {buffers} are not "
                              "0, 1, 2, ... in parameter order")
        found.append((KernelTemplate(m.group("name"), tuple(tparams), params,
                                     text[brace + 1:end - 1], text[m.start():end], file),
                      m.start(), end))
    return found


# ---- A small C preprocessor: enough to expand the explicit instantiations
# (function-like macros, # and ##, rescanning), never to emit code.

_TOKEN = re.compile(r'\s+|[A-Za-z_]\w*|\d[\w.]*|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|##|::|'
                    r'\.\.\.|[^\s\w]')


@dataclass
class _Tok:
    text: str
    hide: frozenset = frozenset()

    @property
    def space(self) -> bool:
        return self.text.isspace()

    @property
    def ident(self) -> bool:
        return bool(re.match(r"[A-Za-z_]\w*$", self.text))


@dataclass
class _Macro:
    params: list[str] | None  # None: object-like
    body: list[_Tok]


def _tokens(text: str) -> list[_Tok]:
    return [_Tok(" " if t.isspace() else t) for t in _TOKEN.findall(text)]


def _directives(text: str) -> tuple[list[str], str]:
    """The preprocessor directives of `text` (continuations joined) and the
    text with every directive line blanked."""
    directives, lines, out = [], text.split("\n"), []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("#"):
            joined = line
            while joined.endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined[:-1] + " " + lines[i]
                out.append("")
            directives.append(joined.strip())
            out.append("")
        else:
            out.append(line)
        i += 1
    return directives, "\n".join(out)


def _macros(directives: list[str], keep_out: tuple[str, ...]) -> dict[str, _Macro]:
    macros: dict[str, _Macro] = {}
    for d in directives:
        m = re.match(r"#\s*define\s+(\w+)(\(([^)]*)\))?\s*(.*)$", d, re.S)
        if m:
            name = m.group(1)
            if name in macros or name in keep_out:  # the first definition wins (#ifndef guards)
                continue
            params = None if m.group(2) is None else [p.strip() for p in m.group(3).split(",")
                                                        if p.strip()]
            macros[name] = _Macro(params, _tokens(m.group(4)))
        m = re.match(r"#\s*undef\s+(\w+)", d)
        if m:
            macros.pop(m.group(1), None)
    return macros


def _args(toks: list[_Tok], open_at: int) -> tuple[list[list[_Tok]], int]:
    """The arguments of the invocation whose '(' is toks[open_at], and the
    index of its ')'."""
    args, cur, depth = [], [], 0
    for i in range(open_at, len(toks)):
        t = toks[i].text
        if t == "(":
            depth += 1
            if depth == 1:
                continue
        elif t == ")":
            depth -= 1
            if depth == 0:
                args.append(cur)
                return args, i
        elif t == "," and depth == 1:
            args.append(cur)
            cur = []
            continue
        cur.append(toks[i])
    raise SourceError("unterminated macro invocation")


def _stringize(toks: list[_Tok]) -> _Tok:
    text = "".join(t.text for t in toks).strip()
    text = re.sub(r"\s+", " ", text)
    return _Tok('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"')


def _expand(toks: list[_Tok], macros: dict[str, _Macro]) -> list[_Tok]:
    out: list[_Tok] = []
    pending = list(toks)
    while pending:
        t = pending.pop(0)
        macro = macros.get(t.text) if t.ident and t.text not in t.hide else None
        if macro is None:
            out.append(t)
            continue
        hide = t.hide | {t.text}
        if macro.params is None:
            pending[:0] = [_Tok(b.text, b.hide | hide) for b in macro.body]
            continue
        j = 0
        while j < len(pending) and pending[j].space:
            j += 1
        if j >= len(pending) or pending[j].text != "(":
            out.append(t)  # a function-like macro's name without arguments
            continue
        args, close = _args(pending, j)
        if macro.params == [] and args == [[]]:
            args = []
        if len(args) != len(macro.params):
            raise SourceError(f"macro {t.text} takes {len(macro.params)} arguments, "
                              f"got {len(args)}")
        raw = dict(zip(macro.params, args))
        body, subst = [b for b in macro.body], []
        k = 0
        while k < len(body):
            b = body[k]
            nxt = next((x for x in body[k + 1:] if not x.space), None)
            prev = next((x for x in reversed(subst) if not x.space), None)
            if b.text == "#" and nxt is not None and nxt.text in raw:
                subst.append(_stringize(raw[nxt.text]))
                k = body.index(nxt, k + 1) + 1
                continue
            if b.text in raw:
                pasted = (nxt is not None and nxt.text == "##") or (prev is not None and
                                                                    prev.text == "##")
                subst.extend(raw[b.text] if pasted else _expand(raw[b.text], macros))
            else:
                subst.append(_Tok(b.text))
            k += 1
        # ## joins its neighbours into one token.
        joined: list[_Tok] = []
        k = 0
        while k < len(subst):
            if subst[k].text == "##":
                while joined and joined[-1].space:
                    joined.pop()
                k += 1
                while k < len(subst) and subst[k].space:
                    k += 1
                left = joined.pop().text if joined else ""
                right = subst[k].text if k < len(subst) else ""
                joined.extend(_tokens(left + right))
            else:
                joined.append(subst[k])
            k += 1
        pending[:close + 1] = [_Tok(x.text, x.hide | hide) for x in joined]
    return out


def _string_value(literals: list[str]) -> str:
    return "".join(bytes(s[1:-1], "utf-8").decode("unicode_escape") for s in literals)


def find_instantiations(toks: list[_Tok]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(host name, template name, template arguments) of every explicit
    instantiation in an expanded token stream: `template FA_HOST_NAME(...)`
    or `template [[host_name(...)]]`, then `kernel void name<args>` or
    `[[kernel]] decltype(name<args>) name<args>`."""
    words = [t.text for t in toks if not t.space]
    found, i = [], 0
    while i < len(words):
        if words[i] != "template":
            i += 1
            continue
        j = i + 1
        literals: list[str] = []
        if words[j:j + 2] == ["FA_HOST_NAME", "("]:
            j += 2
        elif words[j:j + 4] == ["[", "[", "host_name", "("]:
            j += 4
        else:
            i += 1
            continue
        while words[j].startswith('"'):
            literals.append(words[j])
            j += 1
        j += 1  # ')'
        if words[j:j + 2] == ["]", "]"]:
            j += 2
        rest = words[j:j + 400]
        try:
            at = next(k for k in range(len(rest) - 1) if rest[k + 1] == "<" and
                      re.match(r"[A-Za-z_]\w*$", rest[k]) and rest[k] not in ("decltype",))
        except StopIteration:
            raise SourceError(f"instantiation of {_string_value(literals)}: no template "
                              "arguments found") from None
        name = rest[at]
        depth, k, arg = 0, at + 1, []
        while True:
            w = rest[k]
            if w == "<":
                depth += 1
                if depth == 1:
                    k += 1
                    continue
            elif w == ">":
                depth -= 1
                if depth == 0:
                    break
            arg.append(w)
            k += 1
        args = tuple(a.strip() for a in _split_top(" ".join(arg)))
        found.append((_string_value(literals), name, args))
        i = j + k
    return found


# ---- The function constants.

def constants_block(constants) -> str:
    """Program-scope `constant constexpr` values for the kernels'
    FA_FUNCTION_CONSTANT(type, name, index) declarations, from a launch's
    (index, type, bits) triples (type: "boolean", "int32" or "float32"),
    unless the includer has defined FA_FUNCTION_CONSTANT (metal-sim)."""
    import struct

    lines = [CONSTANTS_BEGIN,
             "#ifndef FA_FUNCTION_CONSTANT\n",
             "#define FA_FUNCTION_CONSTANT(type, name, index) FA_INSTREAM_CONSTANT(type, name, index)\n",
             "#define FA_INSTREAM_CONSTANT(type, name, index) "
             "constant constexpr type name = FA_INSTREAM_VALUE_##index;\n",
             "#endif\n"]
    for index, kind, bits in sorted(constants):
        if kind == "boolean":
            value = "true" if bits else "false"
        elif kind == "int32":
            value = str(bits - (1 << 32) if bits >= 1 << 31 else bits)
        elif kind == "float32":
            f = struct.unpack("<f", struct.pack("<I", bits))[0]
            if f != f:
                value = "NAN"
            elif f in (float("inf"), float("-inf")):
                value = "INFINITY" if f > 0 else "-INFINITY"
            else:
                value = f"{f!r}f"
        else:
            raise SourceError(f"function constant {index}: unknown type '{kind}'")
        lines.append(f"#define FA_INSTREAM_VALUE_{int(index)} {value}\n")
    lines.append(CONSTANTS_END)
    return "".join(lines)


def text_key(text: str) -> str:
    """A digest of a generated text without what the function constants'
    values change: the constants block and the values spelt in the kernel's
    name (constants_suffix). metal-sim compiles one text for all of them."""
    import hashlib

    begin = text.find(CONSTANTS_BEGIN)
    if begin >= 0:
        end = text.index(CONSTANTS_END, begin) + len(CONSTANTS_END)
        text = text[:begin] + text[end:]
    text = _NAMED_VALUES.sub(r"\1_fc", text)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def constants_suffix(constants) -> str:
    """The part of a kernel's name that spells its function-constant values
    (MLX caches a compiled library by the kernel's name: one name, one source)."""
    return "fc" + "_".join(str(int(bits)) for _, _, bits in sorted(constants))


_NAMED_VALUES = re.compile(r"(flashattn_\w*?)_fc\d*(?:_\d+)*")


# ---- The shader set.

_RAW_INSTANTIATION = re.compile(r"\btemplate\s*(?:FA_HOST_NAME\s*\(|\[\[\s*host_name\b)")


def _without_instantiations(text: str) -> str:
    """The text with every explicit instantiation of a kernel gone: a macro
    whose replacement instantiates one (`template` and a host name) is
    defined empty, so its invocations vanish, and a written-out
    instantiation is cut up to its ';'."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        start = i
        while lines[i].endswith("\\") and i + 1 < len(lines):
            i += 1
        joined = "\n".join(lines[start:i + 1])
        head = re.match(r"[ \t]*#[ \t]*define[ \t]+\w+(?:\([^)]*\))?", joined)
        if head and re.search(r"\btemplate\b", joined[head.end():]) and \
                re.search(r"\bFA_HOST_NAME\b|\bhost_name\b", joined[head.end():]):
            out.append(head.group(0) + "\n" * (i - start))
        else:
            out.append(joined)
        i += 1
    text = "\n".join(out)
    while True:
        m = _RAW_INSTANTIATION.search(text)
        if not m:
            return text
        depth, i = 0, m.start()
        while i < len(text):
            if text[i] in "([{":
                depth += 1
            elif text[i] in ")]}":
                depth -= 1
            elif text[i] == ";" and depth == 0:
                break
            i += 1
        text = text[:m.start()] + text[i + 1:]


class ShaderSet:
    """The .metal files of one shaders/ directory and the kernels they
    instantiate, by host name."""

    def __init__(self, files: dict[str, str]):
        self.files = dict(files)
        self.instances: dict[str, Instance] = {}
        self._common: dict[str, str] = {}
        for name in sorted(f for f in files if f.endswith(".metal")):
            text = strip_comments(inline_includes(name, self.files))
            kernels = find_kernels(text, name)
            by_name = {k.name: k for k, _, _ in kernels}
            common, last = [], 0
            for _, start, end in kernels:
                common.append(text[last:start])
                last = end
            common.append(text[last:])
            self._common[name] = re.sub(r"\n\s*\n(\s*\n)+", "\n\n",
                                        _without_instantiations("".join(common)))
            directives, code = _directives(text)
            # Expand the code outside every brace: the instantiations are at file scope.
            outside, depth = [], 0
            for c in code:
                if c == "{":
                    depth += 1
                    if depth == 1:
                        outside.append("{")
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        outside.append("}")
                elif depth == 0:
                    outside.append(c)
            expanded = _expand(_tokens("".join(outside)), _macros(directives, ("FA_HOST_NAME",)))
            for kernel, _, _ in kernels:
                if not kernel.template_params:
                    self.instances[kernel.name] = Instance(kernel.name, kernel, ())
            for host, template, args in find_instantiations(expanded):
                if template not in by_name:
                    raise SourceError(f"{name}: {host} instantiates {template}, which is not a "
                                      "kernel defined there")
                kernel = by_name[template]
                if len(args) != len(kernel.template_params):
                    raise SourceError(f"{name}: {host} gives {template} {len(args)} template "
                                      f"arguments, it takes {len(kernel.template_params)}")
                if host in self.instances:
                    raise SourceError(f"host name {host} is instantiated twice")
                self.instances[host] = Instance(host, kernel, args)

    @classmethod
    def from_directory(cls, directory) -> "ShaderSet":
        directory = Path(directory)
        files = {p.name: p.read_text(encoding="utf-8")
                 for p in sorted(directory.iterdir()) if p.suffix in (".metal", ".h")}
        if not any(f.endswith(".metal") for f in files):
            raise SourceError(f"no .metal files in {directory}")
        return cls(files)

    def instance(self, host_name: str) -> Instance:
        try:
            return self.instances[host_name]
        except KeyError:
            raise SourceError(f"no kernel named {host_name!r} is instantiated in the shaders "
                              f"({len(self.instances)} are)") from None

    def _pins(self, inst: Instance) -> str:
        """The template parameters pinned to the instantiation's arguments."""
        lines = []
        for (kind, name), arg in zip(inst.kernel.template_params, inst.args):
            lines.append(f"typedef {arg} {name};" if kind == "typename"
                         else f"constexpr {kind} {name} = {arg};")
        return "".join(f"    {x}\n" for x in lines)

    def mlx_kernel(self, host_name: str, constants=()) -> MlxKernel:
        """Name, header, body and argument names for ``mx.fast.metal_kernel``."""
        inst = self.instance(host_name)
        kernel = inst.kernel
        structs = sorted({p.element({}) for p in kernel.params if p.by_value})
        header, body = self._common[kernel.file], kernel.body
        for s in structs:  # MLX binds every input as a device buffer
            header, body = (re.sub(r"\bconstant\s+" + s + r"\s*&", f"device const {s}&", x)
                            for x in (header, body))
        prologue, inputs, outputs = [self._pins(inst)], [], []
        for p in kernel.params:
            if p.builtin is not None:
                prologue.append(f"    {p.decl} {p.name} = {p.builtin};\n")
                continue
            arg = ("fa_out_" if p.is_output else "fa_in_") + p.name
            (outputs if p.is_output else inputs).append((arg, p))
            if p.by_value:
                prologue.append(f"    device const {p.element({})}& {p.name} = "
                                f"*reinterpret_cast<device const {p.element({})}*>({arg});\n")
            else:
                prologue.append(f"    {p.decl} {p.name} = reinterpret_cast<{p.decl}>({arg});\n")
        # The body at the function's own scope, as in the .metal file: its
        # threadgroup arrays stay declared at kernel scope.
        source = "".join(prologue) + body.strip("\n") + "\n"
        name = f"flashattn_{host_name}_{constants_suffix(constants)}"
        return MlxKernel(name, constants_block(constants) + header, source, tuple(inputs),
                         tuple(outputs), inst)

    def torch_source(self, host_name: str, constants=()) -> str:
        """A whole library for ``torch.mps.compile_shader``: the kernel
        template unchanged, instantiated once under its host name, in the
        form the .metal files instantiate theirs."""
        inst = self.instance(host_name)
        kernel = inst.kernel
        instantiation = ""
        if inst.args:
            bindings = inst.bindings()
            types = [re.sub(r"\b\w+\b", lambda m: bindings.get(m.group(0), m.group(0)), p.decl)
                     for p in kernel.params]
            instantiation = (f"template FA_HOST_NAME(\"{host_name}\") kernel void "
                             f"{kernel.name}<{', '.join(inst.args)}>({', '.join(types)});\n")
        return (constants_block(constants) + self._common[kernel.file] + "\n" +
                kernel.definition + "\n" + instantiation)
