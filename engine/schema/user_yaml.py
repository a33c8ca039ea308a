"""YAML a user gives us (a recipe file, a mergekit config sent as text), read within bounds.

YAML's anchors and aliases let a few hundred bytes stand for millions of values: loading
shares one object per anchor, but whatever then walks the data (json.dumps, a database column,
a merge-key flattening) expands every reference. Deep nesting, for its part, makes recursive
readers raise RecursionError. So the parser's events are read first (the parser keeps its own
stack) and the document bounded as written: nesting depth, values, text. Then it is composed
into its node graph (aliases share nodes: cheap) and its size *as expanded* counted over that
graph, each shared node once; only then is it turned into Python values. A mapping that
arrived as JSON (it cannot alias) is held to the same rule by `check_data`. Every refusal is a
RecipeError naming the caller's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from engine.errors import RecipeError

# Far above any real recipe or mergekit config: a passthrough of 256 slices, a source and a
# weight each, is 6 levels deep, ~3,600 values and ~19 KB of text. The bounds keep what a
# document expands to (and the memory of every copy made of it) to a few megabytes.
MAX_DEPTH = 64  # levels of nesting: mappings and lists inside one another
MAX_VALUES = 100_000  # mappings, lists, keys and scalars, each reference counted again
MAX_TEXT = 1024 * 1024  # characters of scalars (keys included), each reference counted again
_SHOWN = 200  # characters of a parser's message repeated in ours (it may quote the input)


@dataclass(frozen=True)
class Size:
    """What a node (or value) stands for once every alias is written out."""

    values: int  # mappings, lists, keys and scalars
    text: int  # characters of keys and scalars
    depth: int  # mappings and lists inside one another: 0 for a scalar


class _Refused(Exception):
    """A bound crossed while reading; `mark` is where (a yaml Mark), when known."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.mark = problem, mark


# libyaml's parser when PyYAML has it: the same documents and types, parsed in C (the pure-Python
# scanner takes seconds over a megabyte, and its look-ahead is quadratic in open brackets).
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_OPENS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSES = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def load_yaml(text: str, field: str, *, name: str | None = None) -> Any:
    """The YAML document in `text` as Python values (SafeLoader's types), or a RecipeError
    naming `field` (`name`, a file's, begins the message) when it is not YAML or crosses a
    bound: nesting, values or text, counted with every alias written out."""
    try:
        aliased = _scan(text)
        loader = _LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:  # an empty document
                return None
            _bounded(node, aliased=aliased)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _Refused as e:
        raise _error(field, name, e.problem, e.mark) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise _error(field, name, f"not valid YAML: {_cut(problem)}", mark) from None
    except ValueError as e:  # a value its tag cannot hold: a 13th month, an int of 5,000 digits
        said = str(e).partition(";")[0]  # not Python's advice on raising its limit
        raise _error(field, name, f"not valid YAML: {_cut(said)}") from None


def _scan(text: str) -> bool:
    """Read the parser's events (it keeps its own stack; the composer recurses) and refuse a
    document nested deeper than MAX_DEPTH or writing more than MAX_VALUES values or MAX_TEXT
    characters, before anything is built. Whether it has an alias."""
    loader = _LOADER(text)
    tally = _Tally()
    try:
        while loader.check_event():
            tally.add(loader.get_event())
    finally:
        loader.dispose()
    return tally.aliased


class _Tally:
    """The document as written so far: open collections, values, characters of scalars."""

    def __init__(self) -> None:
        self.depth = self.values = self.text = 0
        self.aliased = False

    def add(self, event: yaml.Event) -> None:
        if isinstance(event, _CLOSES):
            self.depth -= 1
            return
        if not isinstance(event, yaml.NodeEvent):
            return  # the stream's and documents' starts and ends
        self.aliased = self.aliased or isinstance(event, yaml.AliasEvent)
        self.depth += isinstance(event, _OPENS)
        self.values += 1
        if isinstance(event, yaml.ScalarEvent):
            self.text += len(event.value)
            if "\0" in event.value:  # a "\0" escape: no path or database text holds one
                raise _Refused(
                    "holds a NUL character, which no name or value may", event.start_mark
                )
        if problem := _crossed(Size(self.values, self.text, self.depth), aliased=False):
            raise _Refused(problem, event.start_mark)


def check_data(value: Any, field: str) -> Size:
    """The rule load_yaml applies, for values that did not come from YAML (a JSON body's
    mapping): its size, or a RecipeError naming `field`. Iterative, so no depth is too deep
    to be refused."""
    values = text = depth = 0
    stack: list[tuple[Any, int]] = [(value, 0)]  # a value, and the collections around it
    while stack:
        item, around = stack.pop()
        values += 1
        if isinstance(item, str):
            text += len(item)
        elif isinstance(item, dict):
            stack += [(part, around + 1) for pair in item.items() for part in pair]
        elif isinstance(item, list | tuple):
            stack += [(part, around + 1) for part in item]
        if isinstance(item, dict | list | tuple):
            depth = max(depth, around + 1)
        if problem := _crossed(Size(values, text, depth), aliased=False):
            raise _error(field, None, problem)
    return Size(values, text, depth)


def _bounded(root: Node, *, aliased: bool) -> Size:
    """The size `root` stands for with every alias written out: a memoised walk over the node
    graph (a node shared by a thousand aliases is counted once, times a thousand). An alias
    inside its own anchor would stand for an infinite document: refused."""
    sizes: dict[int, Size] = {}
    open_: set[int] = set()  # the nodes on the path being walked: their sizes are not known yet
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_.discard(id(node))
            sizes[id(node)] = size = _sum(node, sizes)
            if problem := _crossed(size, aliased=aliased):
                raise _Refused(problem, node.start_mark)
        elif id(node) in open_:
            raise _Refused("an alias refers to the anchor it is inside of", node.start_mark)
        elif id(node) not in sizes:
            open_.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _children(node)]
    return sizes[id(root)]


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _sum(node: Node, sizes: dict[int, Size]) -> Size:
    if isinstance(node, ScalarNode):
        return Size(1, len(node.value), 0)
    parts = [sizes[id(child)] for child in _children(node)]
    return Size(
        1 + sum(p.values for p in parts),
        sum(p.text for p in parts),
        1 + max((p.depth for p in parts), default=0),
    )


def _crossed(size: Size, *, aliased: bool) -> str | None:
    """Which bound `size` crosses, said as a user can act on it; None within them."""
    if size.depth > MAX_DEPTH:
        grown = "with its aliases written out, " if aliased else ""
        return f"{grown}nested more than {MAX_DEPTH} levels deep"
    if size.values <= MAX_VALUES and size.text <= MAX_TEXT:
        return None
    bound = (
        f"more than {MAX_VALUES} values"
        if size.values > MAX_VALUES
        else f"more than {MAX_TEXT // 1024} KiB of text"
    )
    if aliased:
        return f"YAML aliases expand to {bound}; write the config out without anchors"
    return f"holds {bound}"


def _error(field: str, name: str | None, problem: str, mark: Any = None) -> RecipeError:
    details: dict[str, Any] = {"field": field}
    where = ""
    if mark is not None:
        details |= {"line": mark.line + 1, "column": mark.column + 1}
        where = f" (line {mark.line + 1}, column {mark.column + 1})"
    head = f"{field}: {name}: " if name else f"{field}: "
    return RecipeError(f"{head}{problem}{where}", details=details)


def _cut(text: str) -> str:
    text = " ".join(text.split())  # one line: a parser's message may span several
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
