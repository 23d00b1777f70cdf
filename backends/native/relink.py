"""Relink by splicing: a new library from the last full link when only the data changed.

A one-weight change of a model changes two things in its library's inputs:
the weights blob (`weights.S` embeds `weights.bin` in a section of its own,
`.rodata.<prefix>weights`, at the symbol `<prefix>weights`) and the driver's `model_info` array, whose JSON
carries the source's sha256. Every other input (the kernel objects, the rest of
the driver, the flags) is the same, and so are the sizes of those two. The
linker copies the bytes of an input section that has no relocations and is not
mergeable (no SHF_MERGE) to a place in the output that depends only on the
inputs' sizes, symbols and relocations, never on those bytes. So the full link
of the new inputs is the last full link's output with those two byte ranges
replaced -- which is what this module makes, in a few milliseconds instead of
an `as` + `ld` of the whole weights blob through SCons (~1 s for ResNet-18).

It is only done when that holds, checked each time rather than assumed:

- a *template* is stored in the step cache after every full link, under a key
  of everything that reaches the library's bytes except the weights' and the
  model description's contents: the kernel objects, the driver's text outside
  `model_info`, the flags, the compiler and linker versions, this file's code,
  the weights' size. It holds the library without its weights, where the
  weights and `model_info` lie in it, and the driver object of that link;
- the new driver is compiled (the command SCons runs, ~0.1 s) and must equal
  the template's driver object byte for byte outside `model_info`'s bytes, the
  range no relocation touches (checked when the template is made);
- anything else (no template, another compiler, a driver that differs
  elsewhere, a sanitizer build, a static archive, a cross or GPU target) takes
  the full link, which then stores the next template.

tests/test_relink.py checks that a spliced library equals the full link's
bytes, and that a change outside the data takes the full link.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
from functools import lru_cache
from pathlib import Path

_FORMAT = 1
SHF_MERGE = 0x10
SHT_SYMTAB, SHT_RELA, SHT_REL = 2, 4, 9
INFO_SYMBOL = "model_info"
# The driver's description: `static const char model_info[] =\n    "...";` (backends/native/driver.py).
_INFO_DEFINITION = re.compile(r'static const char model_info\[\] =\s*".*?(?<!\\)";', re.S)


# --- a minimal reader of 64-bit little-endian ELF: sections, symbols, relocation offsets

class Elf:
    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        self.data = data
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        self.sections = []
        for i in range(shnum):
            name, kind, flags, addr, offset, size, link, info, _, entsize = struct.unpack_from(
                "<IIQQQQIIQQ", data, shoff + i * shentsize)
            self.sections.append({"name": name, "type": kind, "flags": flags, "addr": addr, "offset": offset,
                                  "size": size, "link": link, "info": info, "entsize": entsize})
        names = self.sections[shstrndx]
        for section in self.sections:
            section["name"] = self._string(names, section["name"])

    def _string(self, table, index) -> str:
        start = table["offset"] + index
        return self.data[start:self.data.index(b"\0", start)].decode()

    def section(self, name: str) -> dict | None:
        return next((s for s in self.sections if s["name"] == name), None)

    def symbols(self, name: str) -> list[dict]:
        """Every .symtab symbol called `name`: value, size, section index."""
        found = []
        for table in (s for s in self.sections if s["type"] == SHT_SYMTAB):
            strings = self.sections[table["link"]]
            for k in range(table["size"] // 24):
                st_name, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", self.data, table["offset"] + 24 * k)
                if self._string(strings, st_name) == name:
                    found.append({"value": value, "size": size, "shndx": shndx})
        return found

    def relocated_offsets(self, index: int) -> list[int]:
        """The offsets in section `index` that relocations patch."""
        offsets = []
        for rel in (s for s in self.sections if s["type"] in (SHT_RELA, SHT_REL) and s["info"] == index):
            step = 24 if rel["type"] == SHT_RELA else 16
            offsets += [struct.unpack_from("<Q", self.data, rel["offset"] + step * k)[0]
                        for k in range(rel["size"] // step)]
        return offsets

    def file_range(self, vaddr: int, size: int) -> tuple[int, int] | None:
        """The file offset of a loaded address range (a linked library's symbol)."""
        for s in self.sections:
            if s["addr"] and s["addr"] <= vaddr and vaddr + size <= s["addr"] + s["size"] and s["type"] != 8:
                return s["offset"] + vaddr - s["addr"], size
        return None


def _info_range(obj: Elf) -> tuple[int, int] | None:
    """The file range of the driver object's `model_info` bytes, when splicing it is sound: one
    definition, in a section that is not mergeable and whose relocations leave it alone."""
    symbols = obj.symbols(INFO_SYMBOL)
    if len(symbols) != 1 or not 0 < symbols[0]["shndx"] < len(obj.sections):
        return None
    symbol, section = symbols[0], obj.sections[symbols[0]["shndx"]]
    if section["flags"] & SHF_MERGE or section["type"] == 8:  # 8: SHT_NOBITS
        return None
    start, end = symbol["value"], symbol["value"] + symbol["size"]
    if any(start - 8 < offset < end for offset in obj.relocated_offsets(symbols[0]["shndx"])):
        return None
    return section["offset"] + start, symbol["size"]


# --- the template: made after a full link, used by the next one

@lru_cache(maxsize=None)
def _tool_line(*command) -> str:
    try:
        out = subprocess.run(list(command), capture_output=True, text=True, check=True)
        return (out.stdout or out.stderr).splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def template_key(cc: str, cflags: list, ldflags: list, libs, prefix: str, library: str, driver_c: str,
                 weights_size: int, kernel_objects: dict[str, bytes]) -> str:
    """The cache key of the template for these link inputs (see the module docstring)."""
    sha = lambda data: hashlib.sha256(data).hexdigest()
    payload = {
        "format": _FORMAT, "code": sha(Path(__file__).read_bytes()),
        "link_code": sha(Path(__file__).with_name("link.py").read_bytes()),
        "cc": cc, "cc_version": _tool_line(cc, "--version"), "ld_version": _tool_line(_tool_line(cc, "-print-prog-name=ld"), "--version"),
        "cflags": list(cflags), "ldflags": list(ldflags), "libs": list(libs), "prefix": prefix, "library": library,
        # the driver's text without its description: the description is spliced, and checked in the object
        "driver": sha(_INFO_DEFINITION.sub("model_info", driver_c, count=1).encode()),
        "weights_size": weights_size, "kernels": {s: sha(kernel_objects[s]) for s in sorted(kernel_objects)},
    }
    return "relink-" + sha(json.dumps(payload, sort_keys=True).encode())


def make_template(library: bytes, driver_object: bytes, weights: bytes, prefix: str) -> bytes | None:
    """The template of a full link's library (None when its layout is not one this module splices)."""
    try:
        lib, obj = Elf(library), Elf(driver_object)
    except (ValueError, struct.error):
        return None
    # The linker merges `.rodata.<prefix>weights` (weights.S: flags "a", never mergeable) into .rodata:
    # the weights are found by their symbol, and must be there.
    weights_symbols = lib.symbols(f"{prefix}weights")
    info_in_object = _info_range(obj)
    info_symbols = lib.symbols(INFO_SYMBOL)
    if len(weights_symbols) != 1 or info_in_object is None or len(info_symbols) != 1:
        return None
    in_library = lib.file_range(weights_symbols[0]["value"], len(weights))
    if in_library is None:
        return None
    w_start, w_size = in_library
    if library[w_start:w_start + w_size] != weights:
        return None
    info_in_library = lib.file_range(info_symbols[0]["value"], info_symbols[0]["size"])
    if info_in_library is None:
        return None
    i_start, i_size = info_in_library
    o_start, o_size = info_in_object
    if i_size != o_size or library[i_start:i_start + i_size] != driver_object[o_start:o_start + o_size]:
        return None
    if not (i_start + i_size <= w_start or w_start + w_size <= i_start):
        return None
    header = json.dumps({"weights": [w_start, w_size], "info": [i_start, i_size], "object_info": [o_start, o_size],
                         "library_size": len(library), "object_size": len(driver_object)}, sort_keys=True).encode()
    # the library without its weights (which may be most of it), then the driver object
    return (struct.pack("<Q", len(header)) + header + library[:w_start] + library[w_start + w_size:]
            + driver_object)


def info_bytes(driver_c: str) -> bytes | None:
    """The bytes of `model_info` as the compiler lays them out (the string literal's bytes and its
    NUL), read from the driver's text; None when the literal holds anything but what
    backends/native/driver.py's c_string writes (plain characters, \\, \", octal escapes)."""
    found = _INFO_DEFINITION.search(driver_c)
    if found is None:
        return None
    definition = found.group(0)
    pieces = re.findall(r'"((?:[^"\\\n]|\\.)*)"', definition[definition.index("=") + 1:])
    text, out, i = "".join(pieces), bytearray(), 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            if ord(ch) >= 128:
                return None
            out.append(ord(ch))
            i += 1
            continue
        digits = re.match(r"[0-7]{1,3}", text[i + 1:i + 4])
        if digits:
            out.append(int(digits.group(0), 8) & 0xFF)
            i += 1 + len(digits.group(0))
        elif text[i + 1:i + 2] in ('\\', '"'):
            out.append(ord(text[i + 1]))
            i += 2
        else:
            return None
    return bytes(out) + b"\0"


def object_from_template(template: bytes, driver_c: str) -> bytes | None:
    """The driver object a compile of `driver_c` makes, without the compiler, when the template's key
    matched (so the driver's text outside `model_info` is the template's, compiled by the same
    compiler with the same flags) and the new description has the template's length: the
    template's object with the description's bytes replaced. The array's contents are data the
    compiler copies (checked when the template was made: not mergeable, no relocation on it);
    with the same text around it and the same size, nothing else in the object can differ.
    None when the length differs (the caller compiles)."""
    try:
        (size,) = struct.unpack_from("<Q", template, 0)
        header = json.loads(template[8:8 + size])
    except (struct.error, ValueError):
        return None
    info = info_bytes(driver_c)
    o_start, o_size = header["object_info"]
    if info is None or len(info) != o_size:
        return None
    old_object = template[8 + size + header["library_size"] - header["weights"][1]:]
    if len(old_object) != header["object_size"]:
        return None
    return old_object[:o_start] + info + old_object[o_start + o_size:]


def splice(template: bytes, driver_object: bytes, weights: bytes) -> bytes | None:
    """The library a full link of `driver_object` and `weights` would make, from the template of a link
    whose inputs differed at most in those two's data; None when the driver differs anywhere else."""
    try:
        (size,) = struct.unpack_from("<Q", template, 0)
        header = json.loads(template[8:8 + size])
    except (struct.error, ValueError):
        return None
    w_start, w_size = header["weights"]
    i_start, i_size = header["info"]
    o_start, o_size = header["object_info"]
    body = template[8 + size:]
    rest = header["library_size"] - w_size
    old_object = body[rest:]
    if (len(weights) != w_size or len(driver_object) != header["object_size"] or len(old_object) != len(driver_object)
            or driver_object[:o_start] != old_object[:o_start]
            or driver_object[o_start + o_size:] != old_object[o_start + o_size:]):
        return None
    # The library's bytes in order: the template's, with the two ranges replaced; one copy in all.
    stripped = memoryview(body)[:rest]
    at = lambda position: position if position <= w_start else position - w_size  # in `stripped`
    regions = sorted([(w_start, w_size, weights), (i_start, i_size, driver_object[o_start:o_start + o_size])])
    parts, position = [], 0
    for start, size, data in regions:
        parts += [stripped[at(position):at(start)], data]
        position = start + size
    parts.append(stripped[at(position):])
    return b"".join(parts)
