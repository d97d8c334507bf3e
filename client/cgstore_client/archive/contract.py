"""Facts derived from the packaged program: the input contract and the tensor-binding table.

Both are *derived*, never declared (docs/design.md, "Vocabulary"): a label carried
beside an artifact can drift from it; a projection read off the archive cannot.

Input contract (``derive_input_contract``)::

    {"v": 1,
     "inputs": [{"name": "inputs_x", "path": "args[0]['x']", "dtype": "float32", "shape": ["s0", 8]}, ...],
     "dims":   {"s0": {"min": 1, "max": 64}},
     "tree":   {"type": "builtins.tuple", "arity": 2, "children": [
                  {"type": "builtins.tuple", "arity": 1, "children": [
                      {"type": "builtins.dict", "arity": 2, "keys": ["x", "y"], "children": ["tensor", "tensor"]}]},
                  {"type": "builtins.dict", "arity": 0, "keys": [], "children": []}]}}

``inputs`` lists the tensor leaves in the order the compiled model takes
them; ``shape`` entries are ints (static) or canonical symbol names (the
graph digest's: ``s0`` is the first dynamic dim of the first input), or a
canonical sympy ``srepr`` for a derived dim. ``dims`` gives every symbol a
shape mentions its range (``max`` absent when unbounded). ``tree`` is the
call signature's pytree (``(args, kwargs)``) with container types, arities
and dict keys; a leaf is ``"tensor"`` or, for a value export specialized
into the graph, ``{"constant": <value>}``. The document holds only strings,
ints, lists and objects.

Binding table (``derive_binding_table``): one row per parameter, buffer,
lifted tensor constant and custom object of the graph signature::

    {"name": "p_lin_weight", "fqn": "lin.weight", "kind": "PARAMETER", "dtype": "float32",
     "shape": [4, 8], "nbytes": 128, "binding": "DYNAMIC", "load_name": "lin.weight", "packaged_bytes": 0}

``binding`` is ``DYNAMIC`` when the value is bound by name at load
(parameters and buffers) and ``STATIC`` when it is a literal of the program
(lifted tensor constants, custom objects, anything AOTI folded).
``load_name`` is the name AOTI's constants map uses for it (what
``load_constants`` must be given), read statically from the generated
wrapper's ``constants_info_`` table; AOTI-only constants (folded ones) get
rows of their own. ``packaged_bytes`` is what the archive itself carries for
the value: 0 in an admissible, weight-free archive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cgstore_client.archive.errors import ProgramInvalid
from cgstore_client.archive.graph import ProgramView, spell_scalar

__all__ = [
    "BINDING_DYNAMIC",
    "BINDING_STATIC",
    "AotiConstant",
    "CONTRACT_VERSION",
    "DTYPE_NAMES",
    "derive_binding_table",
    "derive_input_contract",
    "parse_aoti_constants",
]

CONTRACT_VERSION = 1
BINDING_DYNAMIC = "DYNAMIC"
BINDING_STATIC = "STATIC"

#: torch's export-schema ScalarType codes -> torch dtype names (torch/_export/serde/schema.py).
DTYPE_NAMES: Mapping[int, str] = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "complex32",
    10: "complex64",
    11: "complex128",
    12: "bool",
    13: "bfloat16",
    28: "uint16",
    29: "float8_e4m3fn",
    30: "float8_e5m2",
    31: "float8_e4m3fnuz",
    32: "float8_e5m2fnuz",
    33: "float8_e8m0fnu",
    34: "uint32",
    35: "uint64",
}
_ITEM_SIZES: Mapping[str, int] = {
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "bool": 1,
    "bfloat16": 2,
    "uint16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "uint32": 4,
    "uint64": 8,
}
_DICT_TYPES = frozenset({"builtins.dict", "collections.OrderedDict", "torch.fx.immutable_collections.immutable_dict"})
_SPEC_KINDS = {
    "parameter": ("PARAMETER", "parameter_name"),
    "buffer": ("BUFFER", "buffer_name"),
    "tensor_constant": ("CONSTANT_TENSOR", "tensor_constant_name"),
    "custom_obj": ("CUSTOM_OBJ", "custom_obj_name"),
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dtype_name(code: object) -> str:
    """The torch dtype name for a schema ScalarType code (``dtype<N>`` for a code this table predates)."""
    if not _is_int(code):
        raise ProgramInvalid(f"serialized program: dtype must be an int code, got {code!r}")
    return DTYPE_NAMES.get(code, f"dtype{code}")


# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------


def _dim(view: ProgramView, size: object, where: str) -> int | str:
    if isinstance(size, Mapping):
        if _is_int(size.get("as_int")):
            return size["as_int"]
        expression = size.get("as_expr")
        if isinstance(expression, Mapping) and isinstance(expression.get("expr_str"), str):
            return view.canonical_expression(expression["expr_str"])
    raise ProgramInvalid(f"serialized program: {where} has an unreadable size {size!r}")


def _tensor_meta(view: ProgramView, name: str) -> tuple[str, list[int | str]]:
    meta = view.tensor_values.get(name)
    if not isinstance(meta, Mapping) or not isinstance(meta.get("sizes"), list):
        raise ProgramInvalid(f"serialized program: tensor {name!r} has no tensor_values entry with sizes")
    return dtype_name(meta.get("dtype")), [_dim(view, size, f"tensor {name!r}") for size in meta["sizes"]]


def _nbytes(dtype: str, shape: list[int | str]) -> int | None:
    if dtype not in _ITEM_SIZES or not all(isinstance(dim, int) for dim in shape):
        return None
    count = 1
    for dim in shape:
        count *= dim  # type: ignore[operator]
    return count * _ITEM_SIZES[dtype]


# --------------------------------------------------------------------------
# Input contract
# --------------------------------------------------------------------------


def _root_signature(view: ProgramView) -> Mapping[str, Any]:
    for entry in view.module_call_graph:
        if isinstance(entry, Mapping) and entry.get("fqn") == "" and isinstance(entry.get("signature"), Mapping):
            return entry["signature"]
    raise ProgramInvalid("serialized program: module_call_graph has no root ('') signature")


def _parse_in_spec(text: object) -> Mapping[str, Any]:
    if not isinstance(text, str):
        raise ProgramInvalid("serialized program: in_spec must be a string")
    try:
        protocol_and_tree = json.loads(text)
    except ValueError as exc:
        raise ProgramInvalid(f"serialized program: in_spec is not JSON: {exc}") from None
    if not (isinstance(protocol_and_tree, list) and len(protocol_and_tree) == 2):
        raise ProgramInvalid("serialized program: in_spec must be [protocol, tree]")
    if protocol_and_tree[0] != 1:
        raise ProgramInvalid(f"serialized program: in_spec pytree protocol {protocol_and_tree[0]!r} is not 1")
    return _require_spec_node(protocol_and_tree[1])


def _require_spec_node(node: object) -> Mapping[str, Any]:
    if not isinstance(node, Mapping) or not isinstance(node.get("children_spec"), list):
        raise ProgramInvalid("serialized program: in_spec has a node without children_spec")
    return node


def _user_input_slots(view: ProgramView) -> list[Mapping[str, Any]]:
    """The signature's user-input specs (tensors and specialized constants), in flattening order."""
    return [
        spec
        for spec in view.input_specs
        if isinstance(spec, Mapping) and ("user_input" in spec or "constant_input" in spec)
    ]


def _leaf_kind(spec: Mapping[str, Any]) -> tuple[str | None, object]:
    """(tensor placeholder name, or None) and the leaf's contract spelling."""
    if "constant_input" in spec:
        return None, {"constant": _scalar_tree(spec["constant_input"].get("value"))}
    argument = spec["user_input"].get("arg")
    if isinstance(argument, Mapping) and isinstance(argument.get("as_tensor"), Mapping):
        return argument["as_tensor"].get("name"), "tensor"
    kind = next(iter(argument), "unknown") if isinstance(argument, Mapping) else "unknown"
    return None, kind.removeprefix("as_")


def _scalar_tree(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(key): _scalar_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_scalar_tree(item) for item in value]
    return spell_scalar(value)


def _path_step(keys: list[Any] | None, index: int) -> str:
    if keys is not None and index < len(keys):
        return f"[{keys[index]!r}]"
    return f"[{index}]"


class _ContractBuilder:
    def __init__(self, view: ProgramView) -> None:
        self.view = view
        self.slots = _user_input_slots(view)
        self.next_slot = 0
        self.inputs: list[dict[str, object]] = []

    def tree(self, node: Mapping[str, Any], path: str) -> object:
        children = node["children_spec"]
        if node.get("type") is None:
            return self.leaf(path)
        container_type = str(node["type"])
        keys = self.keys(container_type, node.get("context"))
        projected: dict[str, object] = {"type": container_type, "arity": len(children)}
        if keys is not None:
            projected["keys"] = [_scalar_tree(key) for key in keys]
        elif node.get("context") not in (None, "null"):
            projected["context"] = str(node["context"])
        projected["children"] = [
            self.tree(_require_spec_node(child), path + _path_step(keys, index)) for index, child in enumerate(children)
        ]
        return projected

    @staticmethod
    def keys(container_type: str, context: object) -> list[Any] | None:
        if container_type not in _DICT_TYPES or not isinstance(context, str):
            return None
        try:
            keys = json.loads(context)
        except ValueError:
            return None
        return keys if isinstance(keys, list) else None

    def leaf(self, path: str) -> object:
        if self.next_slot >= len(self.slots):
            raise ProgramInvalid("serialized program: in_spec has more leaves than the signature has user inputs")
        spec = self.slots[self.next_slot]
        self.next_slot += 1
        tensor_name, spelling = _leaf_kind(spec)
        if tensor_name is not None:
            dtype, shape = _tensor_meta(self.view, tensor_name)
            self.inputs.append({"name": tensor_name, "path": path, "dtype": dtype, "shape": shape})
        return spelling


def _root_path(tree: Mapping[str, Any]) -> tuple[list[str], bool]:
    """Path prefixes for the signature root: ``(args, kwargs)`` when it has that shape."""
    is_call = tree.get("type") == "builtins.tuple" and len(tree["children_spec"]) == 2
    return (["args", "kwargs"] if is_call else []), is_call


def _dims(view: ProgramView, inputs: Iterable[Mapping[str, object]]) -> dict[str, dict[str, int]]:
    wanted = {dim for entry in inputs for dim in entry["shape"] if isinstance(dim, str)}  # type: ignore[union-attr]
    dims: dict[str, dict[str, int]] = {}
    for symbol, bounds in view.range_constraints.items():
        canonical = view.symbols.get(symbol, symbol)
        if canonical not in wanted or not isinstance(bounds, Mapping):
            continue
        dims[canonical] = {
            key: value
            for key, value in (("min", bounds.get("min_val")), ("max", bounds.get("max_val")))
            if _is_int(value)
        }
    return dims


def derive_input_contract(view: ProgramView) -> dict[str, object]:
    """The input contract of a program (see the module docstring for the document shape)."""
    root = _parse_in_spec(_root_signature(view).get("in_spec"))
    builder = _ContractBuilder(view)
    prefixes, is_call = _root_path(root)
    if is_call:
        children = [
            builder.tree(_require_spec_node(child), prefix)
            for prefix, child in zip(prefixes, root["children_spec"], strict=True)
        ]
        tree: object = {"type": str(root["type"]), "arity": 2, "children": children}
    else:
        tree = builder.tree(root, "inputs")
    if builder.next_slot != len(builder.slots):
        raise ProgramInvalid(
            f"serialized program: in_spec has {builder.next_slot} leaves but the signature has "
            f"{len(builder.slots)} user inputs"
        )
    return {"v": CONTRACT_VERSION, "inputs": builder.inputs, "dims": _dims(view, builder.inputs), "tree": tree}


# --------------------------------------------------------------------------
# AOTI's constants table, read from the generated wrapper source
# --------------------------------------------------------------------------

_CONSTANT_FIELD_RE = re.compile(rb"^\s*constants_info_\[(\d+)\]\.(\w+)\s*=\s*(.*?);\s*$")
_STRING_LITERAL_RE = re.compile(rb'^"((?:[^"\\]|\\.)*)"$')
_DTYPE_RE = re.compile(rb"cached_torch_dtype_(\w+)")
_CONSTANT_TYPE_RE = re.compile(rb"ConstantType::(\w+)")
_SHAPE_RE = re.compile(rb"^\{\s*((?:-?\d+\s*,\s*)*-?\d+)?\s*\}$")
_CONSTANT_TYPE_NAMES = {
    "Parameter": "PARAMETER",
    "Buffer": "BUFFER",
    "TensorConstant": "CONSTANT_TENSOR",
    "FoldedConstant": "FOLDED_CONSTANT",
    "Unknown": "UNKNOWN",
}


@dataclass(frozen=True)
class AotiConstant:
    """One entry of AOTI's ``constants_info_`` table."""

    index: int
    name: str
    original_fqn: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    from_folded: bool


def _decode_field(field: str, raw: bytes) -> object:
    if field in ("name", "original_fqn"):
        literal = _STRING_LITERAL_RE.match(raw)
        return literal.group(1).decode("ascii", "replace") if literal else None
    if field == "dtype":
        match = _DTYPE_RE.search(raw)
        return match.group(1).decode("ascii") if match else None
    if field == "type":
        match = _CONSTANT_TYPE_RE.search(raw)
        return _CONSTANT_TYPE_NAMES.get(match.group(1).decode("ascii"), "UNKNOWN") if match else None
    if field == "shape":
        match = _SHAPE_RE.match(raw)
        if not match:
            return None
        return tuple(int(dim) for dim in match.group(1).split(b",")) if match.group(1) else ()
    if field == "from_folded":
        return raw.strip() == b"true"
    return None


def parse_aoti_constants(lines: Iterable[bytes]) -> list[AotiConstant]:
    """AOTI's constants table from the lines of a generated wrapper (``*.wrapper.cpp``)."""
    fields: dict[int, dict[str, object]] = {}
    for line in lines:
        if b"constants_info_[" not in line:
            continue
        match = _CONSTANT_FIELD_RE.match(line)
        if not match:
            continue
        index, field = int(match.group(1)), match.group(2).decode("ascii")
        value = _decode_field(field, match.group(3))
        if value is not None:
            fields.setdefault(index, {})[field] = value
    constants = []
    for index in sorted(fields):
        entry = fields[index]
        name = str(entry.get("name", ""))
        constants.append(
            AotiConstant(
                index=index,
                name=name,
                original_fqn=str(entry.get("original_fqn", name)),
                dtype=str(entry.get("dtype", "")),
                shape=tuple(entry.get("shape", ())),  # type: ignore[arg-type]
                kind=str(entry.get("type", "UNKNOWN")),
                from_folded=bool(entry.get("from_folded", False)),
            )
        )
    return constants


# --------------------------------------------------------------------------
# Binding table
# --------------------------------------------------------------------------


def _signature_rows(view: ProgramView) -> list[dict[str, Any]]:
    rows = []
    for spec in view.input_specs:
        if not isinstance(spec, Mapping) or len(spec) != 1:
            raise ProgramInvalid("serialized program: an input spec must be a one-key object")
        ((spec_type, body),) = spec.items()
        if spec_type not in _SPEC_KINDS:
            continue  # user inputs, constant inputs and tokens are not constants of the program
        kind, fqn_key = _SPEC_KINDS[spec_type]
        if not isinstance(body, Mapping) or not isinstance(body.get("arg"), Mapping):
            raise ProgramInvalid(f"serialized program: {spec_type} spec without an arg")
        name = str(body["arg"].get("name"))
        row: dict[str, Any] = {"name": name, "fqn": str(body.get(fqn_key)), "kind": kind}
        if kind == "CUSTOM_OBJ":
            row["class_fqn"] = str(body["arg"].get("class_fqn"))
        else:
            row["dtype"], row["shape"] = _tensor_meta(view, name)
            nbytes = _nbytes(row["dtype"], row["shape"])
            if nbytes is not None:
                row["nbytes"] = nbytes
        if kind == "BUFFER":
            row["persistent"] = spell_scalar(bool(body.get("persistent", True)))
        row["binding"] = BINDING_DYNAMIC if kind in ("PARAMETER", "BUFFER") else BINDING_STATIC
        rows.append(row)
    return rows


def _attach_aoti(rows: list[dict[str, Any]], constants: list[AotiConstant]) -> list[dict[str, Any]]:
    """Give each row AOTI's load name; folded or unmatched AOTI constants become rows of their own."""
    by_fqn = {constant.original_fqn: constant for constant in constants}
    matched: set[int] = set()
    for row in rows:
        constant = by_fqn.get(row["fqn"])
        if constant is not None:
            _bind(row, constant, matched)
    # Lifted tensor constants are re-lifted under new names when AOTI
    # retraces the unlifted module ("lifted_tensor_0" -> "_tensor_constant0");
    # pair what is left, in order, when kind, dtype and shape all agree.
    leftover_rows = [row for row in rows if "load_name" not in row and row["kind"] == "CONSTANT_TENSOR"]
    leftover_constants = [c for c in constants if c.index not in matched and c.kind == "CONSTANT_TENSOR"]
    if len(leftover_rows) == len(leftover_constants) and all(
        row["dtype"] == constant.dtype and row["shape"] == list(constant.shape)
        for row, constant in zip(leftover_rows, leftover_constants, strict=True)
    ):
        for row, constant in zip(leftover_rows, leftover_constants, strict=True):
            _bind(row, constant, matched)
    extra = [_aoti_only_row(constant) for constant in constants if constant.index not in matched]
    return rows + extra


def _bind(row: dict[str, Any], constant: AotiConstant, matched: set[int]) -> None:
    row["load_name"] = constant.original_fqn
    matched.add(constant.index)
    if constant.from_folded:
        row["binding"] = BINDING_STATIC


def _aoti_only_row(constant: AotiConstant) -> dict[str, Any]:
    shape: list[int | str] = list(constant.shape)
    row: dict[str, Any] = {
        "name": constant.name,
        "fqn": constant.original_fqn,
        "kind": "FOLDED_CONSTANT" if constant.from_folded else constant.kind,
        "dtype": constant.dtype,
        "shape": shape,
        "load_name": constant.original_fqn,
    }
    nbytes = _nbytes(constant.dtype, shape)
    if nbytes is not None:
        row["nbytes"] = nbytes
    dynamic = constant.kind in ("PARAMETER", "BUFFER") and not constant.from_folded
    row["binding"] = BINDING_DYNAMIC if dynamic else BINDING_STATIC
    return row


def derive_binding_table(
    view: ProgramView,
    aoti_constants: list[AotiConstant] | None,
    packaged_bytes: Mapping[str, int],
) -> list[dict[str, Any]]:
    """The tensor-binding table (see the module docstring); ``packaged_bytes`` maps fqn -> bytes in the archive."""
    rows = _signature_rows(view)
    if aoti_constants is not None:
        rows = _attach_aoti(rows, aoti_constants)
    for row in rows:
        row["packaged_bytes"] = int(packaged_bytes.get(row["fqn"], 0))
    return rows
