"""Boot by declaration: find a compiled graph without tracing, serve it, confirm it behind the first call.

A worker knows its declaration (family, envelope, sm, toolchain, release) and
its live model's tensors before it has traced anything. :func:`discover` asks
the store for the live records matching that declaration and binding exactly
those tensors (one ``POST /v1/compiled-graphs:discover``); :func:`boot` takes
the first candidate that passes the structural gate, downloads it through
``Client.load``'s verified path, binds it to the live weights and returns a
:class:`Booted` handle that serves it at once.

Trust. The structural gate is: the record's receipt verifies (the store
admitted exactly these bytes under this key), the record binds the same
tensors as the live model (binding signature: every name, dtype and shape),
the example inputs are inside its input contract, and every constant binds.
It guarantees the graph *can* run on these weights and inputs, not that it
computes what the live ``forward`` computes: a patched forward over the same
tensors passes it. Only *confirmation* says that: exporting the live model
and comparing its graph digest with the record's (the store measured it on
admission). ``confirm="before"`` confirms before serving (an export, seconds
to minutes) and, when a candidate drifts, reports it and tries the next one;
``"background"`` serves at once and confirms in a thread,
switching the handle to eager for every later call on drift and reporting
it (``POST …/compiled-graphs/{key}:report``); ``"never"`` trusts the gate.

Offline, or with the store down, discover answers the last answer cached for
the same request (``discover/<digest>.json`` in the client cache), and the
records and blobs it names come from the cache as ``load``'s do.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import blake3

from cgstore_client.errors import CgstoreError, CompiledRequired, NotFound, Offline, Unavailable
from cgstore_client.keys import Envelope, Toolchain, canonical_json
from cgstore_client.wire.discovery import (
    DEFAULT_DISCOVER_LIMIT,
    Candidate,
    DiscoverAnswer,
    DiscoverRequest,
    DriftReport,
    MissExplanation,
)
from cgstore_client.wire.records import MAX_REASON_CHARS, ToolchainAxis
from cgstore_client.worker import outcomes
from cgstore_client.worker.cache import Cache
from cgstore_client.worker.http import Transport, parse_answer, record_path
from cgstore_client.worker.outcomes import Eager, Loaded, admits_contract

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger(__name__)


class Client(Protocol):
    """What boot by declaration needs of ``cgstore_client.Client``, and no more: its transport and
    cache, whether it is offline, and two public operations. Named here rather than imported, so
    the client (whose ``boot`` and ``discover`` call this module) and this module never form a circle."""

    transport: Transport
    writer: Transport
    cache: Cache
    offline: bool

    def serve_hit(self, hit: Candidate) -> Loaded | Eager: ...

    def read_record(self, repo: str, key: str) -> dict[str, Any]: ...


# Booted.confirmation values.
PENDING = "pending"
CONFIRMED = "confirmed"
DRIFT = "drift"
SKIPPED = "skipped"
CONFIRM_MODES = ("background", "before", "never")
#: Reason of a handle that could not be confirmed before serving (the export failed).
UNCONFIRMED = "unconfirmed"
#: ``Booted.reason`` of a handle served compiled from the local cache because the store could not be asked.
SERVED_FROM_CACHE = "served from the local cache"
#: At most this many differing tensors are named in a miss reason.
NAMED_DIFFERENCES = 4


_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()
_SHARED_LOCK = threading.RLock()  # for a model that cannot be weakly referenced
#: While an eager call waits for an export to release the model, how often it looks for a compiled target.
EAGER_RECHECK_S = 0.05


def model_lock(model: Any) -> threading.RLock:
    """The lock held by every export of ``model`` and every eager call of it through a handle.

    A non-strict ``torch.export`` swaps fake tensors into the module's parameters
    for the trace: an eager call of the same module meanwhile, on another
    thread, runs on fake tensors and fails (or kills the process). Exports here
    run beside serving (background confirmation, a mint's export after a
    takeover), so eager calls wait for them instead.
    """
    with _MODEL_LOCKS_GUARD:
        try:
            return _MODEL_LOCKS.setdefault(model, threading.RLock())
        except TypeError:
            return _SHARED_LOCK


@dataclass(frozen=True)
class Serving:
    """What a handle serves at one moment, replaced whole: a reader never sees a new target with an old
    confirmation or reason. ``target``: the compiled callable, None while calls go eager."""

    target: Callable[..., Any] | None
    loaded: Loaded | None
    reason: str | None
    confirmation: str
    served_from: str = "store"


class Booted:
    """What :func:`boot` serves: callable like the model, compiled when it can be.

    ``compiled``: whether calls go to the compiled graph; ``loaded``: the
    record served (kept after a drift or a yank, so it can be named); ``reason``: why
    calls go eager (while compiled: None, or ``served from the local cache
    (unavailable: …)`` when the store could not be asked); ``served_from``:
    ``store`` or ``cache`` (the last answer cached for this declaration);
    ``confirmation``: ``pending``, ``confirmed``, ``drift`` or ``skipped`` (no
    example inputs, ``confirm="never"``, or an export that failed in the background).

    A handle can change target while it serves: a record published for its
    declaration switches it to compiled, a yank or a drift to eager. All of the
    above is one immutable :class:`Serving` (``state``), replaced by a single
    assignment and read once per call: a switch of target, confirmation and
    reason is atomic, and a call in flight finishes on the target it started
    with. A ``mandatory`` handle never runs eager: without a compiled target a
    call raises :class:`CompiledRequired`.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        compiled: Callable[..., Any] | None = None,
        loaded: Loaded | None = None,
        reason: str | None = None,
        confirmation: str = SKIPPED,
        mandatory: bool = False,
    ) -> None:
        self.model = model
        self.mandatory = mandatory
        #: The declaration this handle was booted from (what a later publish or yank is matched against).
        self.declared: Declared | None = None
        #: What moves this handle after boot (``worker.fleet.Follower``), kept alive by it; None: nothing does.
        self.follower: object | None = None
        self._swap_lock = threading.Lock()  # writers only: two switches never interleave their read and write
        self._state = Serving(compiled, loaded, reason, confirmation)
        self._settled = threading.Event()
        self._ready = threading.Event()  # set while compiled: what wait_compiled waits on
        if confirmation != PENDING:
            self._settled.set()
        if compiled is not None:
            self._ready.set()

    @property
    def state(self) -> Serving:
        """What the handle serves now, as one consistent value."""
        return self._state

    def _swap(self, **changes: Any) -> Serving:
        """Replace the state in one assignment; the events follow it (waiters wake on the new state)."""
        with self._swap_lock:
            self._state = state = replace(self._state, **changes)
        if state.target is not None:
            self._ready.set()
        else:
            self._ready.clear()
        return state

    @property
    def compiled(self) -> bool:
        return self._state.target is not None

    @property
    def loaded(self) -> Loaded | None:
        return self._state.loaded

    @property
    def confirmation(self) -> str:
        return self._state.confirmation

    @property
    def served_from(self) -> str:
        return self._state.served_from

    @property
    def reason(self) -> str | None:
        return self._state.reason

    @reason.setter
    def reason(self, reason: str | None) -> None:
        self._swap(reason=reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lock = model_lock(self.model)
        while True:
            state = self._state  # one read: a concurrent switch takes effect on the next call
            if state.target is not None:
                return state.target(*args, **kwargs)
            if self.mandatory:  # never the eager model (e.g. after a yank): the caller retries later
                raise CompiledRequired({self._name(state): state.reason or outcomes.MISS})
            # Eager runs not while an export has fake tensors in the module. An export can take a minute (a
            # background confirmation of the record just switched to): a call waiting for it goes compiled as
            # soon as the handle does, instead of waiting the export out.
            if lock.acquire(timeout=EAGER_RECHECK_S):
                try:
                    return self.model(*args, **kwargs)
                finally:
                    lock.release()

    def wait_confirmed(self, timeout: float | None = None) -> str:
        """Block until confirmation is no longer pending (or ``timeout`` seconds); returns it."""
        self._settled.wait(timeout)
        return self.confirmation

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until calls go to a compiled graph (or ``timeout`` seconds); returns whether they do."""
        self._ready.wait(timeout)
        return self.compiled

    def switch_to_eager(self, reason: str, *, confirmation: str | None = None) -> None:
        """Every later call goes eager (or raises, when mandatory), saying why (and, a drift, with its
        confirmation: target, reason and confirmation change together)."""
        changes: dict[str, Any] = {"target": None, "reason": reason}
        if confirmation is not None:
            changes["confirmation"] = confirmation
        self._swap(**changes)

    _go_eager = switch_to_eager

    def adopt(self, fresh: Booted) -> None:
        """Serve what ``fresh`` (a later boot of the same declaration) serves, in place, in one switch."""
        state = fresh.state
        if state.confirmation == PENDING:
            self._settled.clear()
        self._swap(**{name: getattr(state, name) for name in Serving.__dataclass_fields__})
        if state.confirmation != PENDING:
            self._settled.set()

    def _pending(self) -> None:
        self._settled.clear()
        self._swap(confirmation=PENDING)

    def _settle(self, confirmation: str) -> None:
        self._swap(confirmation=confirmation)
        self._settled.set()

    def _served_from_cache(self, reason: str | None) -> None:
        self._swap(served_from="cache", reason=reason)

    def _name(self, state: Serving | None = None) -> str:
        loaded = (state or self._state).loaded
        if loaded is not None:
            return loaded.key
        return self.declared.family if self.declared is not None else "model"

    def __repr__(self) -> str:
        state = self._state
        key = state.loaded.key if state.loaded else None
        return (
            f"Booted(compiled={state.target is not None}, key={key!r}, confirmation={state.confirmation!r}, "
            f"served_from={state.served_from!r}, reason={state.reason!r})"
        )


@dataclass(frozen=True)
class Declared:
    """A boot's declaration and what serving it needs, kept with its handle so it can be served again later
    (when a record is published for it). ``graph``: a graph digest this model is known to export to: the one
    this worker exported for its own mint, or one a confirmation measured (a record with that graph is this
    model's: confirmed without exporting again)."""

    family: str
    model: Any
    request: DiscoverRequest
    example_inputs: tuple[Any, ...] | None
    checkpoint: Any
    device: str
    confirm: str
    mandatory: bool = False
    graph: str | None = None

    @property
    def discovery_digest(self) -> str:
        """What the store's events and claims name this declaration by (``binding.discovery_digest``)."""
        from cgstore_client.binding import discovery_digest

        envelope = Envelope.from_dict(self.request.envelope)
        toolchain = Toolchain({**self.request.toolchain.components, **self.request.toolchain.recorded})
        return discovery_digest(self.family, envelope.digest, self.request.sm, toolchain.digest, toolchain.recorded)


@dataclass
class Carried:
    """What one serve of a declaration leaves for the next serve of it by the same handle (the follower's upgrades).

    ``bound``: the compiled graph last bound to the live model, by the blobs it was loaded from (artifact and
    component digests). Blobs are content-addressed and the weights are the same live tensors, so a record
    served again with the same blobs (published again after a yank) is bound already: its gate and its receipt
    are checked again, the load and the bind are not repeated. ``phases``: seconds spent in each step of the
    last serve (``discover``, ``fetch``, ``load``), for the log line that says the handle switched.
    """

    bound: dict[tuple[str, ...], Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - started

    def keep(self, loaded: Loaded, compiled: Any) -> None:
        """Remember ``compiled`` as the graph bound from ``loaded``'s blobs (only the last one: its memory)."""
        self.bound = {_blobs_of(loaded): compiled}


def _blobs_of(loaded: Loaded) -> tuple[str, ...]:
    manifest = loaded.manifest
    components = sorted(f"{c['name']}={c['digest']}" for c in manifest.get("components") or [])
    return (manifest.get("artifact", {}).get("digest", ""), *components)


# --- discover ------------------------------------------------------------------------------


def discover_request(
    family: str,
    *,
    envelope: Envelope | Mapping[str, object],
    sm: str,
    toolchain: Toolchain | Mapping[str, str],
    release: str | None = None,
    binding_signature: str | None = None,
    code: str | None = None,
    limit: int = DEFAULT_DISCOVER_LIMIT,
    explain: bool = False,
) -> DiscoverRequest:
    envelope = envelope if isinstance(envelope, Envelope) else Envelope.from_dict(envelope)
    toolchain = toolchain if isinstance(toolchain, Toolchain) else Toolchain(toolchain)
    axis = ToolchainAxis(components=dict(toolchain.components), recorded=dict(toolchain.recorded))
    return DiscoverRequest(
        family=family,
        envelope=envelope.document,
        sm=sm,
        toolchain=axis,
        release=release,
        binding_signature=binding_signature,
        code=code,
        limit=limit,
        explain=explain,
    )


def discover(client: Client, request: DiscoverRequest) -> list[Candidate]:
    """The store's candidates for ``request``, best first; offline or with the store down, the cached answer.

    Raises :class:`Offline` (offline) or :class:`Unavailable` (store down, or a
    store older than the discover route) when no answer to this very request is cached.
    """
    return discover_answer(client, request).answer.candidates


@dataclass(frozen=True)
class Discovered:
    """A discover's answer and where it came from: ``from_cache`` says why the store was not asked (None: it was)."""

    answer: DiscoverAnswer
    from_cache: str | None = None


def discover_answer(client: Client, request: DiscoverRequest) -> Discovered:
    """:func:`discover`, keeping the whole answer (the miss's explanation, when asked) and its source."""
    body = request.model_dump(mode="json", exclude_none=True)
    if not body.get("explain"):  # unsent unless asked: a store from before the field refuses unknown fields
        body.pop("explain", None)
    cached_at = client.cache.discover_path("blake3:" + blake3.blake3(canonical_json(body, hashed=False)).hexdigest())
    if client.offline:
        return _cached_answer(client, cached_at, Offline("offline mode and this declaration was never discovered"))
    try:
        response = client.transport.request("POST", "/v1/compiled-graphs:discover", json=body)
    except Unavailable as err:
        return _cached_answer(client, cached_at, err)
    except NotFound as err:  # a miss is a 200 with no candidates: a 404 is a store from before the route
        return _cached_answer(client, cached_at, Unavailable(f"this store does not serve discovery ({err})"))
    answer = parse_answer(DiscoverAnswer, response.content)
    client.cache.write_json(cached_at, {"candidates": [c.model_dump(mode="json") for c in answer.candidates]})
    return Discovered(answer)


def _cached_answer(client: Client, path, error: CgstoreError) -> Discovered:
    cached = client.cache.read_json(path)
    if cached is None:
        raise error
    return Discovered(DiscoverAnswer.model_validate(cached), from_cache=f"{type(error).__name__.lower()}: {error}")


# --- boot ----------------------------------------------------------------------------------


def boot_by_declaration(
    client: Client,
    family: str,
    model: torch.nn.Module,
    *,
    envelope: Envelope | Mapping[str, object],
    toolchain: Toolchain | Mapping[str, str] | None = None,
    sm: str | None = None,
    release: str | None = None,
    code: bool | str = True,
    mandatory: bool = False,
    confirm: str | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    checkpoint: Any = None,
    device: str = "cpu",
) -> Booted:
    """Serve ``model`` compiled from the first candidate that passes the structural gate, else eager.

    ``code=True`` narrows discovery to records minted from the same source
    (``binding.code_fingerprint``); a string is that fingerprint. ``confirm``
    defaults to ``"before"`` when ``mandatory`` (which raises
    :class:`CompiledRequired` rather than serve eager), else ``"background"``.
    """
    declared = declare(
        family,
        model,
        envelope=envelope,
        toolchain=toolchain,
        sm=sm,
        release=release,
        code=code,
        mandatory=mandatory,
        confirm=confirm,
        example_inputs=example_inputs,
        checkpoint=checkpoint,
        device=device,
    )
    booted = serve_declared(client, declared)
    confirm_in_background(client, booted)
    if mandatory and not booted.compiled:
        raise CompiledRequired({family: booted.reason or outcomes.MISS})
    return booted


def declare(
    family: str,
    model: Any,
    *,
    envelope: Envelope | Mapping[str, object],
    toolchain: Toolchain | Mapping[str, str] | None = None,
    sm: str | None = None,
    release: str | None = None,
    code: bool | str = True,
    mandatory: bool = False,
    confirm: str | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    checkpoint: Any = None,
    device: str = "cpu",
) -> Declared:
    """The declaration of ``model`` (its binding signature and code fingerprint computed, nothing traced)."""
    confirm = confirm or ("before" if mandatory else "background")
    if confirm not in CONFIRM_MODES:
        raise ValueError(f"confirm is one of {CONFIRM_MODES}, not {confirm!r}")
    request = _declaration(family, model, envelope, toolchain, sm, release, code, device)
    return Declared(family, model, request, example_inputs, checkpoint, device, confirm, mandatory)


def serve_declared(client: Client, declared: Declared, carried: Carried | None = None) -> Booted:
    """One discover of ``declared`` and the first candidate through the gate (and, ``confirm="before"``, confirmed).

    A candidate whose graph is ``declared.graph`` (this worker's own export, or
    a graph a confirmation of this model measured) is confirmed as it is: no
    second export. Background confirmation is the caller's
    (:func:`confirm_in_background`, on the handle that will serve). ``carried``:
    what an earlier serve by the same handle left (see :class:`Carried`).
    Never raises for a mandatory declaration: the caller decides.
    """
    carried = carried if carried is not None else Carried()
    carried.phases.clear()
    confirm_each = declared.confirm == "before" and declared.example_inputs is not None
    booted = _boot(
        client,
        declared.family,
        declared.model,
        declared.request,
        declared.example_inputs,
        declared.checkpoint,
        declared.device,
        confirm_each,
        declared.graph,
        carried,
    )
    booted.declared, booted.mandatory = declared, declared.mandatory
    return booted


def confirm_in_background(client: Client, booted: Booted) -> None:
    """Start ``booted``'s background confirmation when its declaration asks for one and it has none yet."""
    declared = booted.declared
    if (
        booted.compiled
        and declared is not None
        and declared.confirm == "background"
        and declared.example_inputs is not None
        and booted.confirmation == SKIPPED
    ):
        _start_confirmation(client, booted, declared.model, declared.example_inputs, background=True)


def _declaration(family, model, envelope, toolchain, sm, release, code, device) -> DiscoverRequest:
    from cgstore_client.binding import code_fingerprint, signature_from_module
    from cgstore_client.environment import environment_sm, environment_toolchain

    fingerprint = code_fingerprint(model) if code is True else (code or None)
    return discover_request(
        family,
        envelope=envelope,
        sm=sm or environment_sm(device),
        toolchain=toolchain or environment_toolchain(),
        release=release,
        binding_signature=signature_from_module(model),
        code=fingerprint,
        explain=True,
    )


def _boot(
    client,
    family,
    model,
    request: DiscoverRequest,
    example_inputs,
    checkpoint,
    device,
    confirm_each: bool,
    known_graph: str | None = None,
    carried: Carried | None = None,
) -> Booted:
    """The first candidate through the structural gate (and, with ``confirm_each``, confirmed), else eager."""
    carried = carried if carried is not None else Carried()
    try:
        with carried.timed("discover"):
            discovered = discover_answer(client, request)
    except Offline as err:
        return Booted(model, reason=f"{outcomes.OFFLINE_NOT_CACHED}: {err}")
    except Unavailable as err:  # down, or too slow (past the call deadline): never hung
        return Booted(model, reason=outcomes.reason_for(err))
    booted = _serve_first(
        client,
        model,
        request,
        discovered.answer,
        example_inputs,
        checkpoint,
        device,
        confirm_each,
        known_graph,
        carried,
    )
    if discovered.from_cache is not None:
        if booted.compiled:  # compiled all the same: say the store was not asked
            booted._served_from_cache(f"{SERVED_FROM_CACHE} ({discovered.from_cache})")
        else:  # a miss answered by the cache is an old answer: say whose
            booted._served_from_cache(
                f"{booted.reason} (the answer cached for this declaration; {discovered.from_cache})"
            )
    return booted


def _serve_first(
    client,
    model,
    request: DiscoverRequest,
    answer: DiscoverAnswer,
    example_inputs,
    checkpoint,
    device,
    confirm_each: bool,
    known_graph: str | None = None,
    carried: Carried | None = None,
) -> Booted:
    carried = carried if carried is not None else Carried()
    candidates = answer.candidates
    shapes = _leaf_shapes(example_inputs) if example_inputs is not None else None
    weights = checkpoint if checkpoint is not None else model.state_dict()
    refusals, drifted = [], None
    for candidate in candidates:
        outcome = _serve_candidate(client, candidate, request.binding_signature, shapes, weights, device, carried)
        if isinstance(outcome, str):
            refusals.append(f"{candidate.key}: {outcome}")
            continue
        loaded, compiled = outcome
        booted = Booted(model, compiled=compiled, loaded=loaded)
        if known_graph is not None and loaded.record["manifest"]["axes"]["graph"] == known_graph:
            booted._settle(CONFIRMED)  # the program this worker exported for its own mint: nothing to export again
            return booted
        if not confirm_each:
            return booted
        _start_confirmation(client, booted, model, example_inputs, background=False)
        if booted.confirmation == SKIPPED:  # the export failed: no candidate can be confirmed
            booted._go_eager(f"{UNCONFIRMED}: the live model could not be exported to confirm the graph")
        if booted.confirmation != DRIFT:
            return booted
        # Same declaration and tensors, another computation (a config flag the declaration does not
        # name): reported already; a later candidate may hold this model's graph.
        if drifted is None:
            drifted = booted
        else:
            refusals.append(f"{candidate.key}: {booted.reason}")
    if drifted is not None:  # every served candidate drifted: the first one's handle says so
        if refusals:
            drifted.reason += f" (other candidates: {'; '.join(refusals)})"
        return drifted
    if refusals:
        return Booted(model, reason=f"{outcomes.MISS}: no candidate could be served ({'; '.join(refusals)})")
    return Booted(model, reason=_miss_reason(client, request, answer.miss, model))


def _serve_candidate(
    client: Client, candidate: Candidate, signature: str | None, shapes, weights, device, carried: Carried
):
    """(Loaded, compiled callable) through the structural gate, or why this candidate is not served.

    The receipt, the blobs (verified, or stamped in the cache) and the gate are checked every time; the load
    and the bind are skipped when ``carried`` holds the graph bound from these very blobs already."""
    from cgstore_client.worker.loader import BindingError, load_compiled

    if candidate.binding_signature != signature:  # the store filters on it; the cache and the client check
        return f"binds other tensors ({candidate.binding_signature})"
    with carried.timed("fetch"):
        served = client.serve_hit(candidate)
    if isinstance(served, Eager):
        return served.reason
    if shapes is not None:
        if missing := _unmatched_inputs(served.input_contract, shapes):
            return f"input structure differs: {missing}"
        if not (verdict := admits_contract(served.input_contract, shapes)):
            return f"the input contract refuses the example inputs: {verdict.detail}"
    if (compiled := carried.bound.get(_blobs_of(served))) is not None:
        return served, compiled
    try:
        with carried.timed("load"):
            compiled = load_compiled(served, weights, device=device)
    except BindingError as err:
        return str(err)
    carried.keep(served, compiled)
    return served, compiled


def _leaf_shapes(example_inputs) -> dict[str, object]:
    """The example inputs' tensors by contract path (``args[0]['x']``)."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(tuple(example_inputs))
    return {"args" + pytree.keystr(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def _unmatched_inputs(contract: Mapping[str, Any], shapes: Mapping[str, object]) -> str | None:
    declared = {spec["path"] for spec in contract.get("inputs") or []}
    if declared == set(shapes):
        return None
    return f"declared {sorted(declared)}, given {sorted(shapes)}"


def _miss_reason(client: Client, request: DiscoverRequest, miss: MissExplanation | None, model) -> str:
    """Why nothing was found, in the store's words (``explain``); tensors named when the binding signature differs."""
    if miss is None:  # a store from before explanations, or an answer from the cache
        return f"{outcomes.MISS}: no candidate for this declaration"
    reason = f"{outcomes.MISS}: {miss.detail}"
    nearest = miss.nearest
    if nearest is None or not any(d.axis == "binding_signature" for d in nearest.differences):
        return reason
    try:
        # At the path the client builds from the names (never an answer's href).
        table = client.read_record(nearest.repo, nearest.key)["binding_table"]
    except (CgstoreError, KeyError) as err:  # a diagnosis only: the miss stands either way
        log.debug("no diagnosis of the tensors: %s", err)
        return reason
    return f"{reason} ({nearest.key}: {_tensor_differences(table, model)})"


def _tensor_differences(table: list[Mapping[str, Any]], model) -> str:
    """What the binding signatures hash, compared name by name: the record's checkpoint rows against the live state."""
    recorded = {row["fqn"]: (row["dtype"], list(row["shape"] or [])) for row in table if row["source"] == "checkpoint"}
    live = {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in model.state_dict().items()}
    differences = [
        f"{name} is {live[name]}, recorded {recorded[name]}"
        for name in sorted(live.keys() & recorded.keys())
        if live[name] != recorded[name]
    ]
    differences += [f"{name} is not recorded" for name in sorted(live.keys() - recorded.keys())]
    differences += [f"{name} is recorded, not in the model" for name in sorted(recorded.keys() - live.keys())]
    shown = "; ".join(differences[:NAMED_DIFFERENCES]) or "the same names, dtypes and shapes"
    return shown + (f" (+{len(differences) - NAMED_DIFFERENCES} more)" if len(differences) > NAMED_DIFFERENCES else "")


# --- confirmation --------------------------------------------------------------------------


def _start_confirmation(client: Client, booted: Booted, model, example_inputs, *, background: bool) -> None:
    booted._pending()
    confirm = lambda: _confirm(client, booted, model, example_inputs)  # noqa: E731
    if background:
        threading.Thread(target=confirm, name="cgstore-confirm", daemon=True).start()
    else:
        confirm()


def _confirm(client: Client, booted: Booted, model, example_inputs) -> None:
    """Export the live model, compare graph digests; on drift switch to eager, warn and report. Never raises."""
    loaded = booted.loaded
    recorded = loaded.record["manifest"]["axes"]["graph"]
    try:
        measured = live_graph_digest(model, example_inputs, loaded.input_contract, recorded=recorded)
    except Exception as err:  # any export failure: serving goes on, unconfirmed
        log.warning("cgstore: could not confirm %s (the live model did not export: %s)", loaded.key, err)
        booted._settle(SKIPPED)
        return
    if measured == recorded:
        declared = booted.declared
        if declared is not None and declared.model is model:  # this model exports to it: no export next time
            booted.declared = replace(declared, graph=measured)
        booted._settle(CONFIRMED)
        return
    reason = f"{DRIFT}: the live model's graph is {measured}, the record's {recorded}"
    # Target, reason and confirmation at once; waiters on the confirmation wake after the report (it may retry).
    booted.switch_to_eager(reason, confirmation=DRIFT)
    log.warning("cgstore: %s from %s serves eager from now on: %s", loaded.key, loaded.repo, reason)
    _report(client, loaded, measured, reason)
    booted._settled.set()


def live_graph_digest(model, example_inputs, contract: Mapping[str, Any], *, recorded: str | None = None) -> str:
    """The graph digest of ``model`` exported on ``example_inputs`` with the contract's dynamic dims.

    The record's graph was exported with symbolic dims (ranges in the
    contract's ``dims``); exporting the live model with the same ranges makes
    an identical computation give an identical digest. A record minted from a
    program that crossed a process (a fleet's mint child loads what its worker
    saved) holds the graph after one save/load round trip, which can differ
    from a fresh export's (:func:`serialized_graph_digest`): when the fresh
    digest is not ``recorded``, the round-tripped one is the answer.
    """
    import torch
    from torch.utils import _pytree as pytree

    from cgstore_client.archive import graph_digest_from_program

    declared = {spec["path"]: spec["shape"] for spec in contract.get("inputs") or []}
    dims = {
        name: torch.export.Dim(name, min=bounds.get("min"), max=bounds.get("max"))
        for name, bounds in (contract.get("dims") or {}).items()
    }

    def dynamic(path, leaf):
        shape = declared.get("args" + pytree.keystr(path)) or []
        return {axis: dims[d] for axis, d in enumerate(shape) if isinstance(d, str) and d in dims} or None

    args = tuple(example_inputs)
    with model_lock(model):
        program = torch.export.export(model, args, dynamic_shapes=pytree.tree_map_with_path(dynamic, args))
    fresh = graph_digest_from_program(program)
    return fresh if recorded in (None, fresh) else serialized_graph_digest(program)


def serialized_graph_digest(program) -> str:
    """The graph digest of ``program`` as an archive holds it: after torch's serialization and back.

    The store measures a record's graph from the program serialized in its archive, and one round
    trip through ``torch.export.save``/``load`` can change what a fresh export says (HF GPT-2's
    attention: a stride torch rewrites on load), after which it is stable. A live model's export is
    compared in that form too when its fresh form does not match, or an unchanged model minted by a
    fleet's child would drift."""
    import io

    import torch

    from cgstore_client.archive import graph_digest_from_program

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return graph_digest_from_program(torch.export.load(buffer))


def _report(client: Client, loaded: Loaded, measured: str, reason: str) -> None:
    """Tell the store (best effort: a report that fails changes nothing for serving)."""
    body = DriftReport(measured_graph=measured, reason=reason[:MAX_REASON_CHARS]).model_dump(mode="json")
    try:
        client.writer.request("POST", record_path(loaded.repo, loaded.key) + ":report", json=body)
    except Exception as err:  # offline, store down, client closed, refused: the drift is logged already
        log.info("cgstore: drift report for %s not delivered: %s", loaded.key, err)
