"""Owner and repo names: the one place that decides what a name is.

Names are strict ASCII and are never normalized. ``Root``, a Cyrillic
``rооt``, a fullwidth ``ｒｏｏｔ`` or ``"acme\\n"`` are not spellings of some
valid name: they are invalid, and answer ``NAME_INVALID``. Normalizing would
let a look-alike slip past the reserved-owner gate or collide with a tenant.

Grammar (docs/protocol.md, "Names"):
  owner  ``[a-z0-9](?:[a-z0-9-]{0,37}[a-z0-9])?``  (1..39 chars, no edge hyphen)
  repo   ``[a-z0-9][a-z0-9._-]{0,99}``              (1..100 chars)
"""

from __future__ import annotations

import re

from cgstore.core.errors import NameInvalid

OWNER_MAX_LEN = 39
REPO_MAX_LEN = 100

# re.ASCII keeps the classes ASCII-only even if someone later writes \w or \d;
# fullmatch (never match + "$") because "$" also matches before a trailing "\n".
OWNER_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,37}[a-z0-9])?", re.ASCII)
REPO_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}", re.ASCII)

ROOT_OWNER = "root"
# Slugs no tenant may claim. Writing under any of them goes through the root
# gate (platform principal + plt token + a grant naming the slug literally).
RESERVED_OWNERS = frozenset({ROOT_OWNER, "admin", "platform", "system", "api"})


def is_valid_owner(value: object) -> bool:
    return _is_ascii_str(value) and OWNER_RE.fullmatch(value) is not None


def is_valid_repo(value: object) -> bool:
    return _is_ascii_str(value) and REPO_RE.fullmatch(value) is not None


def validate_owner(value: object) -> str:
    """Return ``value`` unchanged if it is a valid owner slug, else raise ``NameInvalid``."""
    if not is_valid_owner(value):
        raise NameInvalid(
            f"invalid owner name {_show(value)}: owners are 1-39 characters of "
            "[a-z0-9-], starting and ending with a letter or digit",
            owner=_show(value),
        )
    return value  # type: ignore[return-value]


def validate_repo(value: object) -> str:
    """Return ``value`` unchanged if it is a valid repo name, else raise ``NameInvalid``."""
    if not is_valid_repo(value):
        raise NameInvalid(
            f"invalid repo name {_show(value)}: repos are 1-100 characters of "
            "[a-z0-9._-], starting with a letter or digit",
            repo=_show(value),
        )
    return value  # type: ignore[return-value]


def is_reserved_owner(owner: str) -> bool:
    return owner in RESERVED_OWNERS


def split_repo_path(path: object) -> tuple[str, str]:
    """``"owner/repo"`` → ``("owner", "repo")``, both validated.

    Exactly one ``/``: ``"a/b/c"`` is invalid rather than a nested name.
    """
    if not isinstance(path, str) or path.count("/") != 1:
        raise NameInvalid(f"invalid repo path {_show(path)}: expected <owner>/<repo>", repo=_show(path))
    owner, repo = path.split("/")
    return validate_owner(owner), validate_repo(repo)


def _is_ascii_str(value: object) -> bool:
    # Checked before matching so that no Unicode-aware code path ever sees a
    # non-ASCII name, whatever flags a future edit puts on the regexes.
    return isinstance(value, str) and value.isascii()


def _show(value: object) -> str:
    """A bounded rendering of a rejected name; ascii() escapes newlines and homoglyphs."""
    text = ascii(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= 120 else text[:117] + "..."
