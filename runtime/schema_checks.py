"""Whether a JSON schema admits any finite value, decided before a grammar is built from it.

A grammar engine happily compiles `{"$ref": "#"}`, or an object whose required property
is an object of the same type: no finite text satisfies either, so a constrained
generation can only run into a dead end. This finds such schemas by the usual least
fixed point over "this subschema has a finite instance": a node holds one if its own
keywords can be met with children that hold one (every required property, the first
minItems items, every allOf branch, any anyOf/oneOf branch, its $ref's target).

It answers False only when it can show there is no finite value; keywords it does not
model (patterns, numeric ranges, remote refs) count as satisfiable, and the grammar
engine still judges those.
"""

from __future__ import annotations

# Passes over the schema before giving up (and answering True): each pass settles at least
# one more link of the longest $ref chain; real schemas settle in a few.
_MAX_PASSES = 64
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def admits_finite_value(schema) -> bool:
    nodes = _subschemas(schema)
    finite: dict[int, bool] = {}
    for _ in range(_MAX_PASSES):
        changed = False
        for node in nodes:  # children before parents: a tree settles in one pass
            if not finite.get(id(node)) and _finite(node, schema, finite):
                finite[id(node)] = changed = True
        if not changed:
            return finite.get(id(schema), False)
    return True


def _subschemas(schema) -> list:
    """Every subschema node (dicts and booleans), children before their parents."""
    order, stack, seen = [], [(schema, False)], set()
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if isinstance(node, dict):
            stack.extend((child, False) for child in _children(node))
    return order


def _children(node: dict) -> list:
    children = []
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            children += node[key]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            children += node[key].values()
    for key in _SUBSCHEMAS:
        value = node.get(key)
        children += value if key == "items" and isinstance(value, list) else [value]
    return [child for child in children if isinstance(child, (dict, bool))]


def _finite(node, root, finite: dict[int, bool]) -> bool:
    """Whether `node` has a finite instance, given what `finite` knows of its children."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True

    def holds(child) -> bool:
        if isinstance(child, bool):
            return child
        return not isinstance(child, dict) or finite.get(id(child), False)

    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not None and not holds(target):
            return False
    if "const" in node or "enum" in node:
        return True
    if not all(holds(branch) for branch in _list(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _list(node, key)
        if branches and not any(holds(branch) for branch in branches):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else [None]
    return any(_type_finite(node, kind, holds) for kind in types)


def _type_finite(node: dict, kind, holds) -> bool:
    """Whether a value of type `kind` meets the node's object or array keywords (a node
    without a type admits a number, which meets them all)."""
    if kind == "object" and isinstance(node.get("required"), list):
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        return all(holds(properties.get(name, extra)) for name in node["required"] if isinstance(name, str))
    if kind == "array" and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
        items = node.get("items")
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else \
            items if isinstance(items, list) else []
        rest = items if isinstance(items, (dict, bool)) else True
        least = node["minItems"]
        return all(holds(item) for item in prefix[:least] + ([rest] if least > len(prefix) else []))
    return True


def _list(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _resolve(root, ref) -> object | None:
    """A local reference's target ("#", "#/$defs/Name", any JSON pointer); None otherwise."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
