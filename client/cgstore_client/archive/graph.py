"""The graph digest: one canonical projection of a serialized ExportedProgram.

torch writes the program an archive was compiled from to
``<root>/models/<name>.json`` (``torch._export.serde`` schema). The graph
digest hashes a *projection* of that document which keeps exactly what the
computation is and drops everything that merely describes how or where it
was traced:

kept (a whitelist)
    nodes (op target, arguments, outputs), graph inputs and outputs, every
    value's dtype / shape / strides / storage offset / layout / device,
    symbolic-int/float/bool values, custom-object classes, the graph
    signature (which input is a parameter, buffer, constant or user input,
    with fully-qualified names, and every output's role), range constraints,
    the call signature's pytree specs and argument names, input guards,
    opset versions and the IR dialect (``verifiers``).

dropped
    node ``metadata`` (stack traces, source locations, module stacks,
    ``torch_fn``, ``custom``), ``requires_grad`` (a training flag: the
    compiled graph is inference), symbolic hints (the example inputs' sizes),
    submodule listings without a preserved signature, and the torch /
    schema versions (the toolchain axis owns them). Weight *values* are not
    in the document at all.

renamed
    values (placeholders, node names, node outputs) become ``v0, v1, ...`` in
    order of definition, scope by scope, and subgraph attributes ``g0, g1,
    ...``; symbols become ``s0, s1, ...`` / ``u0, ...`` (per prefix) in order
    of first appearance, starting with the user inputs' shapes. Names are
    bookkeeping (some carry per-process counters); renaming them
    deterministically makes the digest a function of the structure alone.

encoded
    hashed canonical JSON (``keys.canonical_json``) holds only strings,
    integers, lists and objects, so floats become their shortest round-trip
    ``repr`` (``0.5`` -> ``"0.5"``), booleans ``"true"``/``"false"`` and
    ``null`` ``"null"``. The export schema types every field, and union
    members are tagged (``as_float`` vs ``as_string``), so these spellings
    cannot make two different programs collide.

Result: ``"blake3:" + blake3(canonical_json({"v": 1, ...})).hexdigest()``.
Independent of the archive's root folder (the document is read by model
name), of weight values, process and machine. Tied weights (constants sharing
one storage, recorded in the metadata) fold in through :func:`tied_graph_digest`. This module imports no torch;
:func:`graph_digest_from_program` imports it lazily.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cgstore_client.archive.errors import ProgramInvalid
from cgstore_client.keys import digest

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torch.export import ExportedProgram

__all__ = [
    "PROJECTION_VERSION",
    "ProgramView",
    "graph_digest_from_document",
    "graph_digest_from_program",
    "program_ties",
    "tied_graph_digest",
    "program_document_from_program",
    "KEPT_NODE_METADATA",
    "strip_debug_metadata",
]

#: Bumped whenever the projection changes: every graph digest moves with it.
PROJECTION_VERSION = 1

_VALUE_TABLES = ("tensor_values", "sym_int_values", "sym_float_values", "sym_bool_values", "custom_obj_values")
_TENSOR_META_KEYS = ("dtype", "sizes", "strides", "storage_offset", "layout", "device")
# Keys whose string value names a value of the enclosing graph.
_VALUE_REFERENCE_KEYS = frozenset({"name", "as_name", "user_input_name"})
_SYMBOL_RE = re.compile(r"Symbol\('([^'\\]+)'")
# srepr of a lone symbol: ``Symbol('s29', positive=True, integer=True)``.
_LONE_SYMBOL_RE = re.compile(r"Symbol\('([^'\\]+)'(?:, \w+=\w+)*\)")
_SYMBOL_PREFIX_RE = re.compile(r"\A([A-Za-z_]*)")


def spell_scalar(value: object) -> object:
    """Spell a JSON scalar for a hashed document (see the module docstring)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return value


def _require(mapping: object, key: str, where: str) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise ProgramInvalid(f"serialized program: {where} has no {key!r}")
    return mapping[key]


def _require_list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProgramInvalid(f"serialized program: {where} must be a list")
    return value


def _require_mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProgramInvalid(f"serialized program: {where} must be an object")
    return value


# --------------------------------------------------------------------------
# Value names: defined in order, per graph scope
# --------------------------------------------------------------------------


def _argument_names(argument: object) -> Iterator[str]:
    """Every value name an Argument defines or references, in document order."""
    if isinstance(argument, Mapping):
        if "arg" in argument and "name" in argument:  # a NamedArgument: its name is the schema's
            yield from _argument_names(argument["arg"])
            return
        for key, item in argument.items():
            if key == "graph":
                continue  # a nested graph has its own scope
            if key in _VALUE_REFERENCE_KEYS and isinstance(item, str):
                yield item
            else:
                yield from _argument_names(item)
    elif isinstance(argument, list):
        for item in argument:
            yield from _argument_names(item)


class _Scope:
    """Canonical names for the values of one graph, assigned in order of definition."""

    def __init__(self, graph: Mapping[str, Any], where: str) -> None:
        self.names: dict[str, str] = {}
        for argument in _require_list(_require(graph, "inputs", where), f"{where}.inputs"):
            for name in _argument_names(argument):
                self._define(name)
        for node in _require_list(_require(graph, "nodes", where), f"{where}.nodes"):
            self._define(_require(node, "name", f"{where} node"))
            for argument in _require_list(_require(node, "outputs", f"{where} node"), f"{where} node outputs"):
                for name in _argument_names(argument):
                    self._define(name)
        # Values only a table mentions (none in torch's output) still get a
        # stable name: sorted by original name, after every defined value.
        for table in _VALUE_TABLES:
            for name in sorted(graph.get(table) or {}):
                self._define(name)

    def _define(self, name: object) -> None:
        if isinstance(name, str) and name not in self.names:
            self.names[name] = f"v{len(self.names)}"

    def rename(self, name: str) -> str:
        return self.names.get(name, name)


# --------------------------------------------------------------------------
# Projection
# --------------------------------------------------------------------------


class _Projector:
    """Builds the projection of one program; symbol names are canonicalized afterwards."""

    def __init__(self) -> None:
        self.subgraph_names: dict[str, str] = {}

    def argument(self, value: object, scope: _Scope) -> object:
        if isinstance(value, Mapping):
            if "arg" in value and "name" in value:  # NamedArgument: keep the schema argument name
                projected = {"name": spell_scalar(value["name"]), "arg": self.argument(value["arg"], scope)}
                if "kind" in value:
                    projected["kind"] = spell_scalar(value["kind"])
                return projected
            if "graph" in value and "name" in value:  # a subgraph argument (control flow, HOPs)
                return {"name": self._subgraph_name(value["name"]), "graph": self.graph(value["graph"], "subgraph")}
            result: dict[str, object] = {}
            for key, item in value.items():
                if key == "hint":
                    continue  # the example input's value, not the computation
                if key in _VALUE_REFERENCE_KEYS and isinstance(item, str):
                    result[key] = scope.rename(item)
                else:
                    result[key] = self.argument(item, scope)
            return result
        if isinstance(value, list):
            return [self.argument(item, scope) for item in value]
        return spell_scalar(value)

    def _subgraph_name(self, name: object) -> str:
        key = str(name)
        if key not in self.subgraph_names:
            self.subgraph_names[key] = f"g{len(self.subgraph_names)}"
        return self.subgraph_names[key]

    def tensor_meta(self, meta: object, scope: _Scope, where: str) -> dict[str, object]:
        meta = _require_mapping(meta, where)
        return {key: self.argument(meta[key], scope) for key in _TENSOR_META_KEYS if key in meta}

    def node(self, node: Mapping[str, Any], scope: _Scope) -> dict[str, object]:
        if not isinstance(node.get("name"), str):
            raise ProgramInvalid("serialized program: a node name must be a string")
        return {
            "name": scope.rename(node["name"]),
            "target": spell_scalar(_require(node, "target", "node")),
            "inputs": self.argument(_require(node, "inputs", "node"), scope),
            "outputs": self.argument(node["outputs"], scope),
            "is_hop_single_tensor_return": spell_scalar(node.get("is_hop_single_tensor_return")),
        }

    def graph(self, graph: object, where: str) -> dict[str, object]:
        graph = _require_mapping(graph, where)
        scope = _Scope(graph, where)
        tensor_values = _require_mapping(graph.get("tensor_values") or {}, f"{where}.tensor_values")
        projected: dict[str, object] = {
            "inputs": self.argument(graph["inputs"], scope),
            "outputs": self.argument(_require(graph, "outputs", where), scope),
            "nodes": [self.node(_require_mapping(node, f"{where} node"), scope) for node in graph["nodes"]],
            "tensor_values": {
                scope.rename(name): self.tensor_meta(meta, scope, f"{where}.tensor_values[{name!r}]")
                for name, meta in tensor_values.items()
            },
            "is_single_tensor_return": spell_scalar(graph.get("is_single_tensor_return", False)),
        }
        for table in _VALUE_TABLES[1:]:
            values = _require_mapping(graph.get(table) or {}, f"{where}.{table}")
            projected[table] = {scope.rename(name): self.argument(value, scope) for name, value in values.items()}
        return projected

    def module_call_graph(self, entries: object, scope: _Scope) -> list[object]:
        projected = []
        for entry in _require_list(entries, "module_call_graph"):
            signature = _require_mapping(entry, "module_call_graph entry").get("signature")
            if signature is None:
                continue  # a submodule listing: names a module, says nothing about the computation
            projected.append({"fqn": spell_scalar(entry.get("fqn")), "signature": self.argument(signature, scope)})
        return projected


def _walk_expressions(value: object, visit: Callable[[str], None]) -> None:
    """Call ``visit`` on every ``expr_str`` in ``value``, objects in sorted-key order (deterministic)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if isinstance(item.get("expr_str"), str):
                visit(item["expr_str"])
            stack.extend(item[key] for key in sorted(item, reverse=True) if key != "expr_str")
        elif isinstance(item, list):
            stack.extend(reversed(item))


def _rewrite_expressions(value: object, rewrite: Callable[[str], str]) -> object:
    """A copy of ``value`` with ``rewrite`` applied to every ``expr_str`` (and nothing else)."""
    if isinstance(value, Mapping):
        return {
            key: rewrite(item) if key == "expr_str" and isinstance(item, str) else _rewrite_expressions(item, rewrite)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_rewrite_expressions(item, rewrite) for item in value]
    return value


class _Symbols:
    """Canonical symbol names, assigned in order of first appearance (per prefix: s0, s1, u0, ...)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self._counters: dict[str, int] = {}

    def see_expression(self, text: str) -> None:
        for match in _SYMBOL_RE.finditer(text):
            self.see(match.group(1))

    def see(self, symbol: str) -> None:
        if symbol in self.names:
            return
        prefix = _SYMBOL_PREFIX_RE.match(symbol).group(1) or "s"  # type: ignore[union-attr]
        index = self._counters.get(prefix, 0)
        self._counters[prefix] = index + 1
        self.names[symbol] = f"{prefix}{index}"

    def rewrite_expression(self, text: str) -> str:
        return _SYMBOL_RE.sub(lambda match: f"Symbol('{self.names.get(match.group(1), match.group(1))}'", text)

    def rename(self, symbol: str) -> str:
        return self.names.get(symbol, symbol)


class ProgramView:
    """A serialized ExportedProgram document, validated where this package reads it, and its projection.

    ``projection`` is the canonical document the graph digest hashes;
    ``symbols`` maps the program's symbol names to their canonical names
    (the input contract spells dims with them); ``value_names`` maps the
    top-level graph's value names to theirs.
    """

    def __init__(self, document: object) -> None:
        self.document = _require_mapping(document, "the document")
        graph_module = _require_mapping(_require(self.document, "graph_module", "the document"), "graph_module")
        self.graph = _require_mapping(_require(graph_module, "graph", "graph_module"), "graph_module.graph")
        self.signature = _require_mapping(_require(graph_module, "signature", "graph_module"), "signature")
        self.input_specs = _require_list(_require(self.signature, "input_specs", "signature"), "input_specs")
        self.output_specs = _require_list(_require(self.signature, "output_specs", "signature"), "output_specs")
        self.range_constraints = _require_mapping(self.document.get("range_constraints") or {}, "range_constraints")
        self.tensor_values = _require_mapping(self.graph.get("tensor_values") or {}, "tensor_values")
        self.module_call_graph = _require_list(graph_module.get("module_call_graph") or [], "module_call_graph")
        projector = _Projector()
        top_scope = _Scope(self.graph, "graph")
        self.value_names = dict(top_scope.names)
        raw = {
            "v": PROJECTION_VERSION,
            "graph": projector.graph(self.graph, "graph"),
            "signature": {
                "input_specs": projector.argument(self.input_specs, top_scope),
                "output_specs": projector.argument(self.output_specs, top_scope),
            },
            "module_call_graph": projector.module_call_graph(self.module_call_graph, top_scope),
            "treespec_namedtuple_fields": projector.argument(
                graph_module.get("treespec_namedtuple_fields") or {}, top_scope
            ),
            "range_constraints": {
                str(symbol): projector.argument(bounds, top_scope) for symbol, bounds in self.range_constraints.items()
            },
            "guards": sorted(str(guard) for guard in _require_list(self.document.get("guards_code") or [], "guards")),
            "opset_version": projector.argument(self.document.get("opset_version") or {}, top_scope),
            "verifiers": projector.argument(self.document.get("verifiers") or [], top_scope),
        }
        self.symbols = self._canonical_symbols(raw)
        self.projection = self._apply_symbols(raw)
        self.digest = digest(self.projection)

    def _canonical_symbols(self, raw: Mapping[str, Any]) -> dict[str, str]:
        symbols = _Symbols()
        graph = raw["graph"]
        # User-facing order first: the top graph's values in definition order
        # (inputs come first), so the first input's first dynamic dim is s0.
        for name in sorted(graph["tensor_values"], key=lambda value: int(value[1:])):
            _walk_expressions(graph["tensor_values"][name], symbols.see_expression)
        _walk_expressions(raw, symbols.see_expression)
        for symbol in sorted(raw["range_constraints"]):
            symbols.see(symbol)
        return symbols.names

    def _apply_symbols(self, raw: dict[str, Any]) -> dict[str, Any]:
        symbols = _Symbols()
        symbols.names = self.symbols
        projection = dict(raw)
        for key in ("graph", "signature", "module_call_graph", "treespec_namedtuple_fields"):
            projection[key] = _rewrite_expressions(raw[key], symbols.rewrite_expression)
        projection["range_constraints"] = {
            symbols.rename(symbol): bounds for symbol, bounds in raw["range_constraints"].items()
        }
        return projection

    def canonical_expression(self, expression: str) -> str:
        """An ``expr_str`` with canonical symbol names; a lone symbol becomes just its name (``"s0"``)."""
        match = _LONE_SYMBOL_RE.fullmatch(expression)
        if match:
            return self.symbols.get(match.group(1), match.group(1))
        symbols = _Symbols()
        symbols.names = self.symbols
        return symbols.rewrite_expression(expression)


def graph_digest_from_document(document: object) -> str:
    """The graph digest of a decoded ``models/<name>.json`` document."""
    return ProgramView(document).digest


#: Node metadata the mint keeps in an archive's program: user annotations only.
KEPT_NODE_METADATA = frozenset({"custom"})


def strip_debug_metadata(document: object) -> object:
    """A copy of a program document whose nodes keep only :data:`KEPT_NODE_METADATA` (in every subgraph).

    Stack traces carry absolute source paths and source text, and module
    stacks and ``torch_fn`` carry the model's import path (``__main__.Model``
    when a script is run directly, ``pkg.mod.Model`` when imported): either
    would tie an archive's bytes to how and where the mint ran. The graph
    digest ignores node metadata anyway.
    """
    if isinstance(document, Mapping):
        is_node = "target" in document and "inputs" in document and isinstance(document.get("metadata"), Mapping)
        return {
            key: (
                {name: value for name, value in item.items() if name in KEPT_NODE_METADATA}
                if is_node and key == "metadata"
                else strip_debug_metadata(item)
            )
            for key, item in document.items()
        }
    if isinstance(document, list):
        return [strip_debug_metadata(item) for item in document]
    return document


def program_document_from_program(program: ExportedProgram) -> bytes:
    """Serialize ``program`` with torch's own serializer, without weights, constants or example inputs."""
    from torch._export.serde.serialize import serialize  # torch is a mint-side dependency only

    artifact = serialize(program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
    return artifact.exported_program


def tied_graph_digest(program_digest: str, ties: Sequence[Sequence[str]]) -> str:
    """The graph digest of a program whose constants in ``ties`` share storage.

    The serialized program lists tied weights as separate parameters; which of
    them are one tensor is known only to the live program (and recorded by the
    mint in the metadata). Sharing changes what AOTI compiles, so it is part of
    the identity: with ties the digest is ``digest({"v": 1, "program": <digest
    of the projection>, "ties": [[fqn, ...], ...]})`` over canonical tie groups;
    without ties it is the projection's digest unchanged.
    """
    if not ties:
        return program_digest
    return digest({"v": 1, "program": program_digest, "ties": [list(group) for group in ties]})


def program_ties(program: ExportedProgram) -> tuple[tuple[str, ...], ...]:
    """The fully-qualified names of ``program``'s tensors that are one tensor (same storage and view)."""
    from cgstore_client.metadata import canonical_ties

    groups: dict[tuple[object, ...], list[str]] = {}
    for fqn, tensor in sorted({**program.constants, **program.state_dict}.items()):
        if not hasattr(tensor, "untyped_storage"):
            continue  # custom objects hold no tensor storage
        view = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype),
        )
        groups.setdefault(view, []).append(fqn)
    return canonical_ties([names for names in groups.values() if len(names) > 1])


def graph_digest_from_program(program: ExportedProgram) -> str:
    """The graph digest of an in-memory ExportedProgram: torch's serialization, the same projection, its ties."""
    import json

    projected = graph_digest_from_document(json.loads(program_document_from_program(program)))
    return tied_graph_digest(projected, program_ties(program))
