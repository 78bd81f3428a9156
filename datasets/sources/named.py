"""Datasets of several named arrays: which arrays a source writes, their names and roles.

A person chooses arrays with one syntax everywhere (``dt.prepare(arrays=[...])``, the CLI's
repeatable ``--array``)::

    NAME[=FROM][:ROLE]

* ``NAME`` is the array's name in the dataset (and the key of dict batches);
* ``FROM`` is what it is made of: one member of an ``.npz``, or a comma-separated group of
  columns of a table (default: ``NAME`` itself);
* ``ROLE`` is one of :data:`~dasktrain.datasets.format.ROLES` (default: ``targets`` for the
  usual names of targets, ``y``, ``label``, ``labels``, ``target``, ``targets``; else
  ``features``).

``image``, ``img=image``, ``label:targets``, ``meta=age,height:features``, ``id:other``.
For an ``.npz`` the single choice ``all`` adds every member not chosen otherwise, under its
own name, with the default role.

A source that chooses arrays some other way (an image folder with a manifest's extra
columns) needs none of this: it yields more entries in its ``specs``, with roles from
:data:`~dasktrain.datasets.format.ROLES`, and its reader returns them;
:func:`check_specs` holds every source to the same rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dasktrain.datasets.errors import SourceError
from dasktrain.datasets.format import ROLES
from dasktrain.datasets.sources.base import ArraySpec

__all__ = [
    "ALL",
    "ArrayChoice",
    "check_array_name",
    "check_specs",
    "default_role",
    "parse_array_choices",
    "resolve_choices",
]

#: The choice that adds every member of an ``.npz`` not chosen otherwise.
ALL = "all"
#: Names that make an array a target unless its role says otherwise.
TARGET_NAMES = ("y", "Y", "target", "targets", "label", "labels")


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayChoice:
    """One array a person asked for: its name, what it is made of, its role."""

    name: str
    sources: tuple[str, ...]
    """The ``.npz`` member or the table columns it is made of, in order."""
    role: str


def default_role(name: str) -> str:
    """``targets`` for the usual names of targets, else ``features``."""
    return "targets" if name in TARGET_NAMES else "features"


def check_array_name(name: str) -> None:
    """Refuse a name that cannot name an array of a Zarr group (or a dict batch's key)."""
    if not name or name != name.strip():
        raise ValueError(f"array name {name!r} is empty or has spaces around it")
    if "/" in name or name in (".", "..") or name.startswith("__"):
        raise ValueError(f"array name {name!r} cannot name a Zarr array: no '/', no "
                         "leading '__', not '.' or '..'")


def _parse_one(text: str) -> ArrayChoice:
    body, colon, role = text.rpartition(":") if ":" in text else (text, "", "")
    role = role.strip()
    if colon and role not in ROLES:
        raise ValueError(f"array choice {text!r}: unknown role {role!r}; roles: "
                         f"{', '.join(ROLES)}")
    name, equals, sources = body.partition("=")
    name = name.strip()
    check_array_name(name)
    columns = tuple(c.strip() for c in sources.split(",")) if equals else (name,)
    if not all(columns):
        raise ValueError(f"array choice {text!r}: an empty name after '=' (write "
                         "NAME=FROM[:ROLE], FROM a member or comma-separated columns)")
    return ArrayChoice(name, columns, role or default_role(name))


def parse_array_choices(items: str | Sequence[str]) -> tuple[list[ArrayChoice], bool]:
    """The choices ``items`` spell, and whether ``all`` was among them.

    Raises
    ------
    ValueError
        A choice that does not parse, names an unknown role, or an array name twice.
    """
    if isinstance(items, str):
        items = [items]
    choices, rest = [], False
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"arrays must be strings NAME[=FROM][:ROLE], got {item!r}")
        if item.strip() == ALL:
            rest = True
            continue
        choices.append(_parse_one(item))
    names = [c.name for c in choices]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"array name{'s' if len(twice) > 1 else ''} "
                         f"{', '.join(map(repr, twice))} given twice")
    if not choices and not rest:
        raise ValueError("arrays is empty: choose at least one NAME[=FROM][:ROLE]")
    return choices, rest


def resolve_choices(items: str | Sequence[str], available: Sequence[str], *, where: str,
                    what: str, one_each: bool) -> list[ArrayChoice]:
    """The arrays ``items`` choose among ``available`` (members of an archive, columns of
    a table), checked: every source name exists and goes into one array only.

    ``what`` names a source name in messages (``member``, ``column``); ``one_each`` says an
    array is made of exactly one of them (an ``.npz`` member) and allows ``all``.

    Raises
    ------
    SourceError
        An unknown name, a name in two arrays, several members for one array, or ``all``
        where it does not apply.
    """
    try:
        choices, rest = parse_array_choices(items)
    except ValueError as exc:
        raise SourceError(str(exc)) from exc
    if rest and not one_each:
        raise SourceError(f"{where}: the array choice {ALL!r} works for .npz members; group "
                          f"{what}s by name, e.g. image=a,b,c")
    owner: dict[str, str] = {}
    for choice in choices:
        if one_each and len(choice.sources) != 1:
            raise SourceError(f"{where}: array {choice.name!r} is made of one {what}, got "
                              f"{', '.join(map(repr, choice.sources))}")
        unknown = [s for s in choice.sources if s not in available]
        if unknown:
            raise SourceError(
                f"{where} has no {what}{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))} (for array {choice.name!r}); "
                f"{what}s: {list(available)}")
        for source in choice.sources:
            if source in owner:
                other = owner[source]
                raise SourceError(
                    f"{where}: {what} {source!r} is in two arrays, {other!r} and "
                    f"{choice.name!r}" if other != choice.name else
                    f"{where}: {what} {source!r} is twice in array {choice.name!r}")
            owner[source] = choice.name
    if rest:
        taken = {c.name for c in choices}
        for source in available:
            if source in owner:
                continue
            if source in taken:
                raise SourceError(f"{where}: {ALL!r} adds {what} {source!r}, but an array of "
                                  "that name is chosen already; rename one of them")
            try:
                check_array_name(source)
            except ValueError as exc:
                raise SourceError(f"{where}: {ALL!r} adds {what} {source!r}: {exc}; choose "
                                  "it under another name, e.g. name=member") from exc
            choices.append(ArrayChoice(source, (source,), default_role(source)))
    return choices


def check_specs(source: str, specs: Mapping[str, ArraySpec], provenance: Mapping[str, Any],
                arrays: Sequence[str] | None) -> None:
    """Hold any source's arrays to the format's rules: valid names, known roles, at least
    one features array. ``arrays`` (what the person chose) must have been honoured: a
    source that chooses by name records ``"arrays"`` in its provenance, and one that does
    not must not ignore the choice unnoticed.

    Raises
    ------
    SourceError
        Naming the array and the rule.
    """
    for name, spec in specs.items():
        try:
            check_array_name(name)
        except ValueError as exc:
            raise SourceError(f"source {source!r}: {exc}") from exc
        if spec.role not in ROLES:
            raise SourceError(f"source {source!r}: array {name!r} has role {spec.role!r}; "
                              f"roles: {', '.join(ROLES)}")
    if arrays is not None and "arrays" not in provenance:
        raise SourceError(f"source {source!r} does not choose arrays by name (it writes "
                          f"{list(specs)}); arrays= works for .npz files and tables")
    if not any(spec.role == "features" for spec in specs.values()):
        roles = {name: spec.role for name, spec in specs.items()}
        raise SourceError(f"source {source!r}: no array has the role 'features' ({roles}); "
                          "a model needs inputs")
