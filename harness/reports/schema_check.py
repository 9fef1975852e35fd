"""A small JSON Schema (draft 2020-12) validator: exactly the keywords report.schema.json uses.

Pure Python (no torch, no jsonschema: that stays a test dependency), so ``gradequiv
report`` can refuse a malformed report.json before rendering it. A schema that uses a
keyword this module does not implement raises :class:`UnsupportedSchema` when the
validator is built, so the schema cannot silently outgrow it; tests/test_report_checks.py
holds it to ``jsonschema.Draft202012Validator``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DRAFT", "Problem", "UnsupportedSchema", "Validator", "first_problem"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"

#: Keywords that assert something about an instance, in the order they are checked.
ASSERTIONS = ("$ref", "type", "const", "enum", "minimum", "maximum", "required", "properties",
              "additionalProperties", "items", "oneOf")
#: Keywords that assert nothing (annotations, and the place $ref points into).
ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "$defs"})
#: Allowed only at the root: they set the dialect and the base of references.
ROOT_ONLY = frozenset({"$schema", "$id"})
TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})


class UnsupportedSchema(Exception):
    """The schema uses a keyword (or a form of one) that this validator does not implement."""


@dataclass(frozen=True)
class Problem:
    """One way an instance breaks the schema: where (a JSON path such as ``$.cases[0]``),
    the keyword broken, and what is wrong, in words."""

    path: str
    keyword: str
    message: str

    def __str__(self) -> str:
        return f"at {self.path}: {self.message}"


def first_problem(instance: Any, schema: Mapping[str, Any]) -> Problem | None:
    """The first way ``instance`` breaks ``schema``, or None when it is valid."""
    return Validator(schema).first_problem(instance)


class Validator:
    """A schema, checked once for keywords this module implements, and applied to instances."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        if not isinstance(schema, Mapping):
            raise UnsupportedSchema(f"a schema is an object, not {_show(schema)}")
        dialect = schema.get("$schema", DRAFT)
        if dialect != DRAFT:
            raise UnsupportedSchema(f"$schema={dialect!r}: only {DRAFT} is implemented")
        self.schema = schema
        self._check_schema(schema, "#", root=True)

    def first_problem(self, instance: Any) -> Problem | None:
        return next(self.problems(instance), None)

    def problems(self, instance: Any) -> Iterator[Problem]:
        """Every problem, first found first (lazily: the first costs only itself)."""
        return self._problems(instance, self.schema, "$")

    # -- the schema itself --------------------------------------------------------------

    def _check_schema(self, schema: Any, where: str, root: bool = False) -> None:
        if isinstance(schema, bool):
            return  # true: anything; false: nothing
        if not isinstance(schema, Mapping):
            raise UnsupportedSchema(f"{where}: a schema is an object or a boolean, not "
                                    f"{_show(schema)}")
        for keyword in schema:
            if keyword in ROOT_ONLY and not root:
                raise UnsupportedSchema(f"{where}: {keyword!r} below the root is not "
                                        f"implemented (it would change what $ref resolves "
                                        f"against)")
            if keyword not in ASSERTIONS and keyword not in ANNOTATIONS | ROOT_ONLY:
                raise UnsupportedSchema(f"{where}: the keyword {keyword!r} is not implemented "
                                        f"by gradequiv.harness.reports.schema_check; implement "
                                        f"it there (and test it against jsonschema) or leave "
                                        f"it out of the schema")
        kind = schema.get("type")
        if kind is not None:
            kinds = kind if isinstance(kind, list) else [kind]
            if not kinds or any(not isinstance(k, str) or k not in TYPES for k in kinds):
                raise UnsupportedSchema(f"{where}/type: {_show(kind)} names no JSON type")
        if "enum" in schema and not isinstance(schema["enum"], list):
            raise UnsupportedSchema(f"{where}/enum: {_show(schema['enum'])} is not a list")
        for bound in ("minimum", "maximum"):
            if bound in schema and not _is_number(schema[bound]):
                raise UnsupportedSchema(f"{where}/{bound}: {_show(schema[bound])} is not a "
                                        f"number")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
            raise UnsupportedSchema(f"{where}/required: {_show(required)} is not a list of "
                                    f"names")
        if "$ref" in schema:
            self._resolve(schema["$ref"], where)
        for name in ("properties", "$defs"):
            children = schema.get(name, {})
            if not isinstance(children, Mapping):
                raise UnsupportedSchema(f"{where}/{name}: {_show(children)} is not an object")
            for key, child in children.items():
                self._check_schema(child, f"{where}/{name}/{key}")
        for name in ("additionalProperties", "items"):
            if name in schema:
                self._check_schema(schema[name], f"{where}/{name}")
        if "oneOf" in schema:
            branches = schema["oneOf"]
            if not isinstance(branches, list) or not branches:
                raise UnsupportedSchema(f"{where}/oneOf: {_show(branches)} is not a non-empty "
                                        f"list")
            for index, branch in enumerate(branches):
                self._check_schema(branch, f"{where}/oneOf/{index}")

    def _resolve(self, ref: Any, where: str) -> Any:
        """The subschema a ``$ref`` names: only JSON pointers into this document."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedSchema(f"{where}/$ref: {_show(ref)} is not implemented; only "
                                    f"'#/...' pointers into this schema are")
        target: Any = self.schema
        for token in ref[2:].split("/") if ref != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or token not in target:
                raise UnsupportedSchema(f"{where}/$ref: {ref!r} points at nothing")
            target = target[token]
        return target

    # -- instances ------------------------------------------------------------------------

    def _problems(self, instance: Any, schema: Any, path: str) -> Iterator[Problem]:
        if schema is True:
            return
        if schema is False:
            yield Problem(path, "false", f"{_show(instance)} is not allowed here")
            return
        if "$ref" in schema:
            yield from self._problems(instance, self._resolve(schema["$ref"], path), path)
        if "type" in schema:
            kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_is_type(instance, kind) for kind in kinds):
                names = ", ".join(repr(kind) for kind in kinds)
                yield Problem(path, "type", f"{_show(instance)} is not of type {names}")
                return  # the other keywords' complaints about a wrong type are noise
        if "const" in schema and not _equal(instance, schema["const"]):
            yield Problem(path, "const", f"{_show(schema['const'])} was expected, not "
                                         f"{_show(instance)}")
        if "enum" in schema and not any(_equal(instance, v) for v in schema["enum"]):
            options = ", ".join(_show(v) for v in schema["enum"])
            yield Problem(path, "enum", f"{_show(instance)} is not one of [{options}]")
        if _is_number(instance):
            if "minimum" in schema and instance < schema["minimum"]:
                yield Problem(path, "minimum", f"{_show(instance)} is less than the minimum "
                                               f"of {_show(schema['minimum'])}")
            if "maximum" in schema and instance > schema["maximum"]:
                yield Problem(path, "maximum", f"{_show(instance)} is greater than the "
                                               f"maximum of {_show(schema['maximum'])}")
        if isinstance(instance, dict):
            for name in schema.get("required", []):
                if name not in instance:
                    yield Problem(path, "required", f"{name!r} is a required property")
            properties = schema.get("properties", {})
            extra = schema.get("additionalProperties", True)
            for key, value in instance.items():
                child = _member(path, key)
                if key in properties:
                    yield from self._problems(value, properties[key], child)
                elif extra is False:
                    yield Problem(path, "additionalProperties",
                                  f"additional property {key!r} is not allowed")
                else:
                    yield from self._problems(value, extra, child)
        if isinstance(instance, list) and "items" in schema:
            for index, item in enumerate(instance):
                yield from self._problems(item, schema["items"], f"{path}[{index}]")
        if "oneOf" in schema:
            problem = self._one_of(instance, schema["oneOf"], path)
            if problem is not None:
                yield problem

    def _one_of(self, instance: Any, branches: list[Any], path: str) -> Problem | None:
        firsts = [next(self._problems(instance, branch, path), None) for branch in branches]
        matched = [index for index, problem in enumerate(firsts) if problem is None]
        if len(matched) == 1:
            return None
        if matched:
            return Problem(path, "oneOf", f"{_show(instance)} is valid under each of the "
                                          f"schemas {matched} where exactly one is allowed")
        # Where every branch but one fails on the type alone, that one meant this instance:
        # its own first problem says more than "valid under none".
        meant = [p for p in firsts if p is not None and not (p.keyword == "type"
                                                              and p.path == path)]
        if len(meant) == 1:
            return meant[0]
        return Problem(path, "oneOf", f"{_show(instance)} is not valid under any of the given "
                                      f"schemas")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "number":
        return _is_number(value)
    # integer: a number with no fractional part (draft 2020-12: 1.0 is an integer)
    return _is_number(value) and (isinstance(value, int) or float(value).is_integer())


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1 is 1.0, and containers compare by their members."""
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _member(path: str, key: str) -> str:
    """The JSON path of ``key`` below ``path``: ``$.name``, or ``$['odd key']`` (as
    jsonschema's ``ValidationError.json_path`` spells it)."""
    if _PLAIN_KEY.match(key):
        return f"{path}.{key}"
    escaped = key.replace("\\", "\\\\").replace("'", "\\'")
    return f"{path}['{escaped}']"


_PLAIN_KEY = re.compile("^[a-zA-Z][a-zA-Z0-9_]*$")


def _show(value: Any, limit: int = 60) -> str:
    """A value as it reads in the JSON (strings quoted 'like this'), cut to ``limit``."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, sort_keys=False)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
