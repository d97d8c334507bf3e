"""Cap-token grants: what a token may do, where. Pure: no database, no clock.

A grant is an ``<owner>/<repo>`` pattern plus a set of actions. JSON form (the
``grants`` claim and request bodies)::

    {"repo": "acme/*", "actions": ["read", "write"]}

CLI form: ``acme/*:read,write`` (the pattern ends at the first ``:``, so
``acme/*:read,owner:create`` is two actions).

Matching rules, each one closing a hole:

- Owner and repo are matched separately, each against a validated name. So
  ``acme/*`` never matches ``acme-evil/x``, and no glob can reach across the
  ``/`` (a pattern may contain only one ``/``).
- Globs know only ``*`` and ``?`` (matched with ``fnmatchcase``); ``[``, ``!``
  and any other character outside the name alphabets is refused at parse time.
- A wildcard owner pattern never matches a reserved owner (``root``,
  ``admin``, ...): a grant over ``root`` names ``root`` literally.
- ``write`` implies ``read`` (anyone who may publish into a repo may see what
  is there); no other action implies another.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from cgstore.core.errors import BadRequest
from cgstore.core.names import (
    RESERVED_OWNERS,
    is_valid_owner,
    is_valid_repo,
)
from cgstore_client.wire.tokens import MAX_GRANTS

READ, WRITE, OWNER_CREATE, ADMIN = "read", "write", "owner:create", "admin"
ACTIONS = frozenset({READ, WRITE, OWNER_CREATE, ADMIN})
# Which actions each action also grants.
_IMPLIED = {WRITE: frozenset({READ})}

WILDCARD = "*"
_GLOB_CHARS = frozenset("*?")
# The alphabets of the two parts, plus the two glob characters. Lengths are
# capped a little above the longest name: a longer pattern could match nothing
# useful and only costs matching time.
_OWNER_GLOB_RE = re.compile(r"[a-z0-9*?-]{1,64}", re.ASCII)
_REPO_GLOB_RE = re.compile(r"[a-z0-9._*?-]{1,128}", re.ASCII)


class GrantInvalid(BadRequest):
    """A grant that cannot be parsed: bad pattern, unknown action, wrong shape."""


@dataclass(frozen=True)
class Grant:
    """``owner_pattern/repo_pattern`` with ``actions``. Build with ``parse_grant``."""

    owner_pattern: str
    repo_pattern: str
    actions: frozenset[str]

    @property
    def pattern(self) -> str:
        return f"{self.owner_pattern}/{self.repo_pattern}"

    @property
    def effective_actions(self) -> frozenset[str]:
        """``actions`` plus what they imply (``write`` → ``read``)."""
        implied = (_IMPLIED.get(action, frozenset()) for action in self.actions)
        return self.actions.union(*implied)

    def matches(self, owner: str, repo: str) -> bool:
        """Whether the pattern covers ``owner/repo``. Invalid names match nothing."""
        return owner_pattern_matches(self.owner_pattern, owner) and repo_pattern_matches(self.repo_pattern, repo)

    def allows(self, owner: str, repo: str, action: str) -> bool:
        return action in self.effective_actions and self.matches(owner, repo)

    def to_json(self) -> dict[str, object]:
        return {"repo": self.pattern, "actions": sorted(self.actions)}

    def to_cli(self) -> str:
        return f"{self.pattern}:{','.join(sorted(self.actions))}"


# -- parsing -----------------------------------------------------------------


def parse_grant(value: object) -> Grant:
    """A ``Grant`` from a ``Grant``, its JSON form (a mapping) or its CLI form (a string)."""
    if isinstance(value, Grant):
        return value
    if isinstance(value, Mapping):
        return _parse_json(value)
    if isinstance(value, str):
        return _parse_cli(value)
    raise GrantInvalid(f"a grant must be an object or a string, not {type(value).__name__}")


def parse_grants(values: Iterable[object]) -> tuple[Grant, ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise GrantInvalid("grants must be a list")
    grants = tuple(parse_grant(value) for value in values)
    if len(grants) > MAX_GRANTS:
        raise GrantInvalid(f"at most {MAX_GRANTS} grants per token, got {len(grants)}")
    return grants


def grants_to_json(grants: Iterable[Grant]) -> list[dict[str, object]]:
    return [grant.to_json() for grant in grants]


def _parse_json(doc: Mapping) -> Grant:
    if set(doc) != {"repo", "actions"}:
        raise GrantInvalid('a grant is {"repo": "<owner>/<glob>", "actions": [...]}, exactly those keys')
    actions = doc["actions"]
    if not isinstance(actions, list):
        raise GrantInvalid("grant actions must be a list of strings")
    return _build(doc["repo"], actions)


def _parse_cli(text: str) -> Grant:
    pattern, colon, actions = text.partition(":")
    if not colon:
        raise GrantInvalid(f"grant {text!r} has no actions: expected '<owner>/<glob>:<action>[,<action>...]'")
    return _build(pattern, [action.strip() for action in actions.split(",")])


def _build(pattern: object, actions: list) -> Grant:
    owner_pattern, repo_pattern = _parse_pattern(pattern)
    return Grant(owner_pattern, repo_pattern, _parse_actions(actions))


def _parse_pattern(pattern: object) -> tuple[str, str]:
    if not isinstance(pattern, str) or pattern.count("/") != 1:
        raise GrantInvalid(f"grant pattern {_show(pattern)} must be '<owner>/<repo glob>' with exactly one '/'")
    owner_pattern, repo_pattern = pattern.split("/")
    if not _valid_part(owner_pattern, is_valid_owner, _OWNER_GLOB_RE):
        raise GrantInvalid(
            f"grant owner pattern {_show(owner_pattern)}: an owner name, or a glob of [a-z0-9-] with * and ?"
        )
    if not _valid_part(repo_pattern, is_valid_repo, _REPO_GLOB_RE):
        raise GrantInvalid(
            f"grant repo pattern {_show(repo_pattern)}: a repo name, or a glob of [a-z0-9._-] with * and ?"
        )
    return owner_pattern, repo_pattern


def _valid_part(part: str, is_valid_name, glob_re: re.Pattern) -> bool:
    if not part.isascii():
        return False
    if is_glob(part):
        return glob_re.fullmatch(part) is not None
    # A literal must be a name that could exist: "Acme" would silently match nothing.
    return is_valid_name(part)


def _parse_actions(actions: list) -> frozenset[str]:
    if not actions:
        raise GrantInvalid("a grant needs at least one action")
    unknown = [a for a in actions if not isinstance(a, str) or a not in ACTIONS]
    if unknown:
        raise GrantInvalid(
            f"unknown grant action(s) {', '.join(_show(a) for a in unknown)}; known: {', '.join(sorted(ACTIONS))}"
        )
    return frozenset(actions)


def _show(value: object) -> str:
    text = ascii(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


# -- matching ----------------------------------------------------------------


def is_glob(part: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in part)


def owner_pattern_matches(pattern: str, owner: str) -> bool:
    if not is_valid_owner(owner):
        return False
    if not is_glob(pattern):
        return pattern == owner
    # The root gate's second lock: no wildcard, however spelled, reaches a reserved owner.
    if owner in RESERVED_OWNERS:
        return False
    return fnmatchcase(owner, pattern)


def repo_pattern_matches(pattern: str, repo: str) -> bool:
    if not is_valid_repo(repo):
        return False
    if not is_glob(pattern):
        return pattern == repo
    return fnmatchcase(repo, pattern)


def grant_allows(grants: Iterable[Grant], owner: str, repo: str, action: str) -> bool:
    """Whether any grant allows ``action`` on ``owner/repo``."""
    return any(grant.allows(owner, repo, action) for grant in grants)


def grant_allows_owner(grants: Iterable[Grant], owner: str, action: str) -> bool:
    """Whether a grant allows an owner-wide ``action`` (e.g. ``owner:create``) on ``owner``.

    Owner-wide means the grant covers every repo of the owner: its repo part is ``*``.
    """
    return any(
        action in grant.effective_actions
        and grant.repo_pattern == WILDCARD
        and owner_pattern_matches(grant.owner_pattern, owner)
        for grant in grants
    )


# -- attenuation ---------------------------------------------------------------


# Actions where a grant naming an owner literally is authority of its own
# (``access.can_write``: a literal owner is written under whoever holds it),
# while a wildcard owner reaches only the holder's own owners.
LITERAL_OWNER_ACTIONS = frozenset({WRITE, ADMIN})


def is_subset(child: Iterable[Grant], parent: Iterable[Grant], *, held_owners: Collection[str] = ()) -> bool:
    """Whether ``child`` allows nothing that ``parent`` does not.

    Checked per (child grant, action): some single parent grant must hold the
    action and cover the child's pattern. Coverage is decided conservatively
    (``_part_covered``): a child that *might* be narrower but is not provably
    so is refused, never let through. ``held_owners`` are the owners the
    token's principal holds (attenuation keeps the principal): only under
    those does a parent's wildcard owner cover a literal one for
    ``LITERAL_OWNER_ACTIONS`` (``_owner_covered``).
    """
    parent = tuple(parent)
    return all(
        any(
            action in p.effective_actions
            and _owner_covered(c.owner_pattern, p.owner_pattern, action, held_owners)
            and _part_covered(c.repo_pattern, p.repo_pattern, repo_pattern_matches)
            for p in parent
        )
        for c in child
        for action in c.actions
    )


def _owner_covered(child: str, parent: str, action: str, held_owners: Collection[str]) -> bool:
    """Whether the parent's owner pattern covers the child's for ``action``.

    A wildcard owner means "the holder's own owners" and must keep meaning it
    through any attenuation: were ``*`` to cover ``victim`` for ``write``, the
    child's literal ``victim`` would be authority the parent never had.
    """
    if action in LITERAL_OWNER_ACTIONS and is_glob(parent) and not is_glob(child) and child not in held_owners:
        return False
    return _part_covered(child, parent, owner_pattern_matches)


def literal_owners(grants: Iterable[Grant]) -> frozenset[str]:
    """The owners ``grants`` name literally (the ones whose holder attenuation must know)."""
    return frozenset(g.owner_pattern for g in grants if not is_glob(g.owner_pattern))


def _part_covered(child: str, parent: str, matches) -> bool:
    """Whether every name ``child`` matches is matched by ``parent`` (one part).

    Provable cases only: the same pattern; a literal child the parent matches
    (with the same reserved-owner rule, so ``*`` never covers ``root``); or a
    parent ``*``, which matches every valid name a child glob can (child globs
    never match reserved owners either).
    """
    if child == parent:
        return True
    if not is_glob(child):
        return matches(parent, child)
    return parent == WILDCARD
