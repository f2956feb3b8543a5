"""Which of a request's tools a call's arguments belong to, when the model did not say (Kimi-K2
sometimes writes a bare counter or a client's call id where ``functions.NAME:IDX`` belongs).

The rule is SGLang's: a name only when it is certain. One tool: that one, whatever the arguments
(checking them is the client's business, as for any call). Several: the complete argument object
must be valid under exactly one tool's parameters schema, where a schema that does not say what
other keys may appear (``additionalProperties``, ``patternProperties``) allows only the keys it
declares (its own ``properties`` and those of its ``allOf`` / ``anyOf`` / ``oneOf`` branches).
Two tools that accept the arguments (``{"path"}`` fits both Glob and LS), none, a schema that cannot
be evaluated (a reference outside itself): no name, and the caller drops the call rather than hand
the client an executable call of a tool the model may not have meant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_BRANCHES = ("allOf", "anyOf", "oneOf")


def infer_tool(schemas: Mapping[str, Any] | None, names: frozenset[str], arguments: str | None) -> str | None:
    """The one tool ``arguments`` (raw JSON text) can be a call of, or None. ``schemas`` maps each
    name to its parameters schema (None: no parameters); None: unknown, and only a lone tool is certain."""
    if len(names) == 1:
        return next(iter(names))
    if not names or schemas is None or not arguments:
        return None
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    try:
        fits = [name for name in sorted(names) if accepts(schemas.get(name), args)]
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot evaluate: no name is certain
        return None
    return fits[0] if len(fits) == 1 else None


def accepts(schema: Any, args: dict) -> bool:
    """Whether a tool with parameters ``schema`` takes ``args`` (the module's rule)."""
    if schema is None or schema is True:
        return not args  # no parameters declared: only the empty object
    if schema is False or not isinstance(schema, dict):
        return False
    if "additionalProperties" not in schema and "patternProperties" not in schema:
        if not set(args) <= declared_keys(schema, schema):
            return False
    import jsonschema  # only when a call must be attributed by its arguments
    import referencing

    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    # an empty registry: a reference outside the schema raises instead of being fetched
    return validator_cls(schema, registry=referencing.Registry()).is_valid(args)


def declared_keys(node: Any, root: dict, depth: int = 0) -> set[str]:
    """The property names ``node`` declares, through its composition branches and local ``$ref``s."""
    if not isinstance(node, dict) or depth > 16:
        return set()
    ref = node.get("$ref")
    if isinstance(ref, str):
        node = {**_local(root, ref), **{k: v for k, v in node.items() if k != "$ref"}}
    keys = set(node.get("properties") or {})
    for branch in _BRANCHES:
        for sub in node.get(branch) or ():
            keys |= declared_keys(sub, root, depth + 1)
    return keys


def _local(root: dict, ref: str) -> dict:
    if not ref.startswith("#"):
        raise ValueError(f"$ref {ref!r}: only references inside the schema are followed")
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    if not isinstance(node, dict):
        raise ValueError(f"$ref {ref!r}: not a schema object")
    return node
