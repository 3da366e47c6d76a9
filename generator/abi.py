"""Kernel parameter structs: one schema, rendered into C++ for the kernel and recorded in the
manifest for the host (docs/CONTRACTS.md §3).

A family module declares each params struct as a :class:`ParamsStruct` (an ordered list of
``(field, type)``). :meth:`ParamsStruct.layout` computes offsets and size with C's natural
alignment rules; :meth:`ParamsStruct.cpp` renders the struct plus ``static_assert``s on ``sizeof``
and every ``offsetof`` from that same layout, so a disagreement between the compiler and the host
packer fails the build instead of corrupting a launch. The runtime packs argument bytes from the
layout the manifest records (``flashgen.launch.ParamsPacker``); nothing else describes the struct.
"""
from __future__ import annotations

from dataclasses import dataclass

#: type -> (C type used when the field gives none, size and alignment in bytes, struct format char)
TYPES = {
    "i32": ("int", 4, "i"),
    "u32": ("unsigned int", 4, "I"),
    "i64": ("long long", 8, "q"),
    "f32": ("float", 4, "f"),
    "ptr": ("void*", 8, "Q"),  # a device address (an int on the host)
}


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # a key of TYPES
    ctype: str | None = None  # C spelling, e.g. "const float*" for a ptr; default from TYPES

    def __post_init__(self):
        if self.type not in TYPES:
            raise ValueError(f"params field {self.name}: type {self.type!r} not one of {', '.join(TYPES)}")


@dataclass(frozen=True)
class ParamsStruct:
    """An ordered C struct of scalars and device pointers, passed to a kernel by value."""

    name: str
    fields: tuple

    def layout(self) -> dict:
        """``{"struct", "size", "fields": [[name, type, offset], ...]}`` with natural alignment."""
        off, align, out = 0, 1, []
        for f in self.fields:
            size = TYPES[f.type][1]
            off = -(-off // size) * size
            out.append([f.name, f.type, off])
            off += size
            align = max(align, size)
        return {"struct": self.name, "size": -(-off // align) * align, "fields": out}

    def cpp(self) -> str:
        """The C++ declaration inside ``namespace flashgen`` plus the layout's static_asserts
        (the including source must include <cstddef> for offsetof)."""
        lay = self.layout()
        lines = [f"struct {self.name} {{"]
        for f, (_, _, off) in zip(self.fields, lay["fields"]):
            lines.append(f"  {f.ctype or TYPES[f.type][0]} {f.name};  // offset {off}")
        lines.append("};")
        lines.append(f'static_assert(sizeof({self.name}) == {lay["size"]}, '
                     f'"{self.name}: size differs from the host layout");')
        for name, _, off in lay["fields"]:
            lines.append(f'static_assert(offsetof({self.name}, {name}) == {off}, '
                         f'"{self.name}.{name}: offset differs from the host layout");')
        return "\n".join(lines)


def params_struct(name: str, *fields) -> ParamsStruct:
    """``params_struct("FwdParams", ("lse", "ptr", "float*"), ("seqlen_q", "i32"), ...)``."""
    return ParamsStruct(name, tuple(Field(*f) for f in fields))


def render_decls(structs) -> str:
    """C++ source declaring every struct in ``structs`` (deduplicated by name) in namespace flashgen."""
    seen, body = set(), []
    for s in structs:
        if s.name not in seen:
            seen.add(s.name)
            body.append(s.cpp())
    return "namespace flashgen {\n" + "\n\n".join(body) + "\n}  // namespace flashgen"
