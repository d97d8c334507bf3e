"""Admission of a compiled-graph manifest, in docs/protocol.md's order; no HTTP, no database writes.

Every check uses the client package's contract code: the key is recomputed
with ``cgstore_client.keys``, the archive is read with
``cgstore_client.archive.inspect``, components with
``cgstore_client.components``. One derivation, used when stamping, looking up
and admitting.

Order (the first failing step answers):

1. key grammar (``KEY_INVALID``) and the key recomputed from the axes
   (``KEY_MISMATCH``; an envelope that cannot be canonicalized, e.g. without
   ``text_len``, is ``ENVELOPE_INVALID``: no key can be derived from it);
2. kind and format (``KIND_RETIRED`` by name, else ``KIND_UNSUPPORTED``);
3. family, lane, layout, component names and release (``NAME_INVALID``,
   ``METADATA_INVALID`` for a malformed lane or code fingerprint, ``DIGEST_INVALID``), then what
   must serialize in every later read (``METADATA_INVALID``: a free-form field
   nesting past ``MAX_FREE_FORM_DEPTH`` or larger than ``MAX_FREE_FORM_BYTES``,
   a string in one that is not valid Unicode);
4. (the caller checks the blobs are in the repo: ``BLOB_UNKNOWN``);
5. the archive, read statically in place through ranged reads (``inspect_stored``): structure, limits,
   paths, weight- and pickle-freedom (``ARTIFACT_INVALID``), metadata
   (``METADATA_INVALID``), then the measured graph digest (``GRAPH_MISMATCH``),
   the derived input contract (``CONTRACT_MISMATCH``), the device facts
   against ``sm`` (``SM_MISMATCH``) and the envelope against the contract's
   dims (``ENVELOPE_INVALID`` naming the axis: a promise the graph cannot keep);
6. components' safetensors headers against the program's constants
   (``CONTRACT_MISMATCH`` naming the tensor), and the binding policy: every
   constant comes from the checkpoint or a component (``ARTIFACT_INVALID``
   naming the constants that come from neither).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cgstore.core.errors import (
    ArtifactInvalid,
    ContractMismatch,
    DigestInvalid,
    EnvelopeInvalid,
    GraphMismatch,
    KeyInvalid,
    KeyMismatch,
    KindRetired,
    KindUnsupported,
    MetadataInvalid,
    NameInvalid,
    SmMismatch,
    from_client_error,
)
from cgstore.storage.ranged import RangedFile, ReadRange
from cgstore_client.archive import DEFAULT_LIMITS, ArchiveError, ArchiveReport, inspect, inspect_zip
from cgstore_client.archive.kind import FORMAT_ZIP, sniff_format
from cgstore_client.binding import discovery_digest, from_checkpoint, is_code_fingerprint, is_release
from cgstore_client.components import ComponentHeader, ComponentInvalid, header_length, read_header
from cgstore_client.errors import EnvelopeError, ToolchainError
from cgstore_client.errors import KeyInvalid as ClientKeyInvalid
from cgstore_client.keys import Envelope, Toolchain, ck1, digest, is_digest, validate_key, validate_sm
from cgstore_client.metadata import KIND_AOT_INDUCTOR, KIND_RETIRED_INDUCTOR_CACHE, is_lane
from cgstore_client.wire.records import Manifest, ToolchainAxis, unservable

FORMAT_PT2 = "pt2"
SOURCE_CHECKPOINT = "checkpoint"
COMPONENT_SOURCE_PREFIX = "component:"
_FAMILY_RE = re.compile(r"\A[a-z0-9][a-z0-9._-]{0,99}\Z", re.ASCII)
_COMPONENT_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9._-]{0,127}\Z", re.ASCII)
#: A stored archive is read in place: deflated entries inflated whole, stored ones where parsed (``inspect_stored``).
STORED_LIMITS = dataclasses.replace(DEFAULT_LIMITS, verify_stored_entries=False)
ZIP_MAGIC_BYTES = 4


@dataclass(frozen=True)
class Derived:
    """What the manifest's axes canonicalize to."""

    envelope: Envelope
    toolchain: Toolchain


@dataclass(frozen=True)
class Admitted:
    """What admission established about an archive and its components."""

    report: ArchiveReport
    binding_table: list[dict[str, Any]]


# -- steps 1-3: the manifest alone ---------------------------------------------------------


def check_manifest(key: str, manifest: Manifest) -> Derived:
    """Steps 1-3: key grammar, key from the axes, kind, names. Raises the step's protocol error."""
    try:
        validate_key(key)
    except ClientKeyInvalid as exc:
        raise KeyInvalid(str(exc), key=key[:120]) from None
    derived = _derive(manifest)
    expected = ck1(manifest.axes.graph, derived.envelope, manifest.axes.sm, derived.toolchain)
    if expected != key:
        raise KeyMismatch("the key is not the one derived from the manifest's axes", key=key, derived=expected)
    _check_kind(manifest)
    _check_names(manifest)
    _check_servable(manifest)
    return derived


def _derive(manifest: Manifest) -> Derived:
    axes = manifest.axes
    derived = derive_axes(axes.envelope, axes.sm, axes.toolchain)
    if not is_digest(axes.graph):
        raise KeyMismatch(f"no key can be derived from the axes: graph digest {axes.graph!r} is not 'blake3:' + 64 hex")
    return derived


def derive_axes(envelope: Mapping[str, Any], sm: str, toolchain: ToolchainAxis) -> Derived:
    """The envelope, sm and toolchain axes canonicalized, as publish and discover both read them.

    An envelope that cannot be canonicalized is ``ENVELOPE_INVALID``; a bad sm or
    toolchain is ``KEY_MISMATCH`` (no key can be derived from them).
    """
    try:
        canonical = Envelope.from_dict(envelope)
    except EnvelopeError as exc:
        raise EnvelopeInvalid(f"envelope: {exc}") from None
    overlap = set(toolchain.components) & set(toolchain.recorded)
    if overlap:
        raise KeyMismatch(f"toolchain components named both keyed and recorded: {sorted(overlap)}")
    try:
        # One mapping, classified by the client: a keyed component sent as "recorded" is keyed anyway.
        stack = Toolchain({**toolchain.components, **toolchain.recorded})
        validate_sm(sm)
    except (ToolchainError, ClientKeyInvalid, ValueError) as exc:
        raise KeyMismatch(f"no key can be derived from the axes: {exc}") from None
    return Derived(canonical, stack)


def discovery_of(family: str, sm: str, derived: Derived) -> str:
    """The discovery digest of a declaration (``cgstore_client.binding``): what discover matches records on."""
    return discovery_digest(family, derived.envelope.digest, sm, derived.toolchain.digest, derived.toolchain.recorded)


def check_family(family: str) -> None:
    if not _FAMILY_RE.match(family):
        raise NameInvalid("family must match [a-z0-9][a-z0-9._-]{0,99}", family=family)


def check_release(release: str | None) -> None:
    if release is not None and not is_release(release):
        raise NameInvalid("release must match [a-z0-9][a-z0-9._-]{0,127}", release=release)


def check_code(code: str | None) -> None:
    if code is not None and not is_code_fingerprint(code):
        raise MetadataInvalid("code must be 'cf1:' + 64 lowercase hex (cgstore_client.binding)", code=code)


def _check_kind(manifest: Manifest) -> None:
    if manifest.kind == KIND_RETIRED_INDUCTOR_CACHE:
        raise KindRetired(
            f"kind {KIND_RETIRED_INDUCTOR_CACHE!r} is retired and refused; publish {KIND_AOT_INDUCTOR!r} (.pt2)",
            kind=manifest.kind,
        )
    if manifest.kind != KIND_AOT_INDUCTOR:
        raise KindUnsupported(f"kind {manifest.kind!r} is not accepted; only {KIND_AOT_INDUCTOR!r}", kind=manifest.kind)
    if manifest.format != FORMAT_PT2:
        raise KindUnsupported(
            f"format {manifest.format!r} is not accepted; only {FORMAT_PT2!r}", format=manifest.format
        )


def _check_names(manifest: Manifest) -> None:
    check_family(manifest.family)
    if not is_lane(manifest.lane):
        raise MetadataInvalid("lane must be <linear>+<modulation>", lane=manifest.lane)
    digests = [manifest.artifact.digest, *(c.digest for c in manifest.components)]
    if manifest.layout is not None:
        digests += [manifest.layout.topology, manifest.layout.quant]
    for value in digests:
        if not is_digest(value):
            raise DigestInvalid("digests are 'blake3:' + 64 lowercase hex", digest=value)
    names = [component.name for component in manifest.components]
    for name in names:
        if not _COMPONENT_NAME_RE.match(name):
            raise NameInvalid("component names match [a-z0-9][a-z0-9._-]{0,127}", component=name)
    if len(set(names)) != len(names):
        raise NameInvalid("component names must be unique within a record", components=names)
    check_release(manifest.release)
    check_code(manifest.code)


def _check_servable(manifest: Manifest) -> None:
    """What is stored must serialize in every later read: free-form fields bounded, their text valid Unicode.

    Typed string fields need no check here: the schema already refuses a lone surrogate in them.
    """
    free_form = {
        "evidence.kernel_lane_evidence": manifest.evidence.kernel_lane_evidence,
        "evidence.mint_phases": manifest.evidence.mint_phases,
        "input_contract": manifest.input_contract,
    }
    for field, document in free_form.items():
        problem = unservable(document)
        if problem is not None:
            raise MetadataInvalid(f"{field} {problem}", field=field)


def component_set_digest(components: list[tuple[str, str, int]]) -> str:
    """Identity of a record's component set, compared on re-publish (same artifact AND same components)."""
    return digest({"v": 1, "components": [list(c) for c in sorted(components)]})


# -- step 5: the archive -------------------------------------------------------------------


def inspect_stored(read_range: ReadRange, size: int, spool_dir: str | None = None) -> ArchiveReport:
    """Read the stored artifact statically, through ranged reads of only what the checks need.

    A zip is read where it lies (``RangedFile``): its end records and central
    directory, every local header, the first bytes of every entry, the records
    the reader parses and every deflated entry (inflated with the ratio and size
    caps). Stored entries the reader does not parse (the compiled shared object,
    the bulk of a ``.pt2``) are not read whole: their size cannot lie (the local
    headers are checked against the directory, and no two entries overlap), and
    their CRC, which proves nothing the blob's verified digest does not, is
    checked by the worker's loader before anything is loaded. Anything else (a
    tarball, a retired cache) is spooled to a temp file (always removed) so the
    refusal names its kind. Memory stays at a few blocks whatever the archive's
    size; the reader's own size limits apply before a byte is read.
    """
    if size > DEFAULT_LIMITS.max_archive_bytes:
        raise ArtifactInvalid(f"archive of {size} bytes exceeds {DEFAULT_LIMITS.max_archive_bytes}", size=size)
    try:
        head = b"".join(read_range(0, ZIP_MAGIC_BYTES)) if size >= ZIP_MAGIC_BYTES else b""
        if sniff_format(head) == FORMAT_ZIP:
            return inspect_zip(RangedFile(read_range, size), limits=STORED_LIMITS)
        return _inspect_spooled(read_range(0, size), spool_dir)
    except ArchiveError as exc:
        raise from_client_error(exc) from None


def _inspect_spooled(chunks: Iterator[bytes], spool_dir: str | None) -> ArchiveReport:
    fd, path = tempfile.mkstemp(prefix="cgstore-admit-", suffix=".pt2", dir=spool_dir)
    try:
        with os.fdopen(fd, "wb") as spool:
            for chunk in chunks:
                spool.write(chunk)
        return inspect(path)
    finally:
        os.unlink(path)


def check_archive(report: ArchiveReport, manifest: Manifest) -> None:
    """Graph digest, declared input contract and sm, against what the archive says."""
    if report.graph_digest != manifest.axes.graph:
        raise GraphMismatch(
            "the claimed graph digest is not the archive's", claimed=manifest.axes.graph, measured=report.graph_digest
        )
    if manifest.input_contract is not None and manifest.input_contract != report.input_contract:
        raise ContractMismatch(
            "the declared input contract differs from the one derived from the archive",
            derived=report.input_contract,
        )
    if report.sm != manifest.axes.sm:
        raise SmMismatch(
            f"the archive was compiled for {report.sm!r}, the manifest says {manifest.axes.sm!r}",
            measured=report.sm,
            claimed=manifest.axes.sm,
        )
    check_envelope_fits(Envelope.from_dict(manifest.axes.envelope), report.input_contract)


# -- the envelope against the input contract --------------------------------------------------
#
# The envelope is a promise (the region the record serves), the contract the fact read off the
# archive. Which dim of which input an envelope axis speaks for is a convention, written once here
# and in docs/client.md ("Declaring the serving region"); an input the convention does not cover
# is never a reason to refuse:
#   batch_sizes  dim 0 of every input of rank >= 2 (a rank-1 input, a timestep or a bias, has no batch);
#   text_len     (when > 0) dim 1 of every integer input of rank >= 2: token ids and masks, (batch, sequence);
#   shapes       (width, height) against dims 3 and 2 of every floating input of rank 4 (N, C, H, W),
#                in pixels or in latents (/ LATENT_SCALE).

LATENT_SCALE = 8
_INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"})


def check_envelope_fits(envelope: Envelope, contract: Mapping[str, Any]) -> None:
    """Refuse (``ENVELOPE_INVALID``, naming the axis) an envelope declaring what the contract's dims exclude."""
    dims = contract.get("dims") or {}
    for spec in contract.get("inputs") or []:
        shape, name, dtype = list(spec.get("shape") or []), spec.get("name"), spec.get("dtype")
        if len(shape) >= 2:
            for size in envelope.batch_sizes:
                _refuse_unless(_fits(shape[0], size, dims), "batch_sizes", size, name, 0, shape[0], dims)
        if envelope.text_len > 0 and dtype in _INTEGER_DTYPES and len(shape) >= 2:
            _refuse_unless(
                _fits(shape[1], envelope.text_len, dims), "text_len", envelope.text_len, name, 1, shape[1], dims
            )
        if dtype in _FLOAT_DTYPES and len(shape) == 4:
            for width, height in envelope.shapes:
                fits = any(
                    _fits(shape[2], height / scale, dims) and _fits(shape[3], width / scale, dims)
                    for scale in (1, LATENT_SCALE)
                )
                _refuse_unless(fits, "shapes", [width, height], name, "2:4", shape[2:], dims)


def _fits(dim: Any, value: float, dims: Mapping[str, Any]) -> bool:
    """Can this dim take ``value``: a static size equal to it, or a declared range holding it (else unknown: yes)."""
    if isinstance(dim, bool):
        return True
    if isinstance(dim, int):
        return dim == value
    bounds = dims.get(dim) if isinstance(dim, str) else None
    if not isinstance(bounds, Mapping):
        return True  # an expression or a symbol without a declared range: nothing to hold the promise against
    if value != int(value):
        return False
    low, high = bounds.get("min"), bounds.get("max")
    return (low is None or value >= low) and (high is None or value <= high)


def _refuse_unless(fits: bool, axis: str, declared: Any, name: str, at: Any, dim: Any, dims: Mapping[str, Any]) -> None:
    if fits:
        return
    bounds = dims.get(dim) if isinstance(dim, str) else None
    held = f"{dim} in [{bounds.get('min')}, {bounds.get('max')}]" if isinstance(bounds, Mapping) else f"{dim}"
    raise EnvelopeInvalid(
        f"envelope {axis} declares {declared}, which the graph cannot take: input {name} dim {at} is {held}",
        axis=axis,
        declared=declared,
        input=name,
        dim=dim if not isinstance(dim, list) else list(dim),
    )


# -- step 6: components and bindings ---------------------------------------------------------


def component_header(name: str, read_range, size: int) -> ComponentHeader:
    """The safetensors header of a component blob, read by two bounded ranges (never the tensors)."""
    try:
        prefix = b"".join(read_range(0, min(8, size)))
        length = header_length(prefix, size)
        return read_header(prefix + b"".join(read_range(8, 8 + length)), size)
    except ComponentInvalid as exc:
        raise ArtifactInvalid(f"component {name!r}: {exc}", component=name) from None


def bind(report: ArchiveReport, headers: Mapping[str, ComponentHeader]) -> list[dict[str, Any]]:
    """The record's binding table: every constant of the program and where its value comes from."""
    constants = {row["fqn"]: row for row in report.binding_table}
    from_component = _component_bindings(constants, headers)
    table, unbound = [], []
    for row in report.binding_table:
        source = from_component.get(row["fqn"]) or (SOURCE_CHECKPOINT if from_checkpoint(row) else None)
        if source is None:
            unbound.append(row["fqn"])
            continue
        table.append(
            {
                "name": row["name"],
                "fqn": row["fqn"],
                "kind": row["kind"],
                "dtype": row.get("dtype"),
                "shape": row.get("shape"),
                "load_name": row.get("load_name"),
                "source": source,
            }
        )
    if unbound:
        raise ArtifactInvalid(
            "constants whose value is in neither the checkpoint nor a component (a lifted tensor literal, "
            f"a non-persistent buffer): {unbound}; bind each to a named component",
            constants=unbound,
        )
    return table


def _component_bindings(
    constants: Mapping[str, Mapping[str, Any]], headers: Mapping[str, ComponentHeader]
) -> dict[str, str]:
    bound: dict[str, str] = {}
    for name, header in headers.items():
        for tensor in header.tensors:
            row = constants.get(tensor.name)
            where = {"component": name, "tensor": tensor.name}
            if row is None or "dtype" not in row:
                raise ContractMismatch(f"component {name!r}: {tensor.name!r} is not a constant of the program", **where)
            if tensor.dtype != row["dtype"] or list(tensor.shape) != row["shape"]:
                raise ContractMismatch(
                    f"component {name!r}: {tensor.name!r} is {tensor.dtype}{list(tensor.shape)}, "
                    f"the program declares {row['dtype']}{row['shape']}",
                    **where,
                    declared={"dtype": row["dtype"], "shape": row["shape"]},
                )
            if tensor.name in bound:
                raise ContractMismatch(f"{tensor.name!r} is bound by two components", **where)
            bound[tensor.name] = COMPONENT_SOURCE_PREFIX + name
    return bound
