"""Owner and repo names: strict ASCII, never normalized (core/names.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgstore.core.errors import NameInvalid
from cgstore.core.names import (
    RESERVED_OWNERS,
    ROOT_OWNER,
    is_reserved_owner,
    split_repo_path,
    validate_owner,
    validate_repo,
)

VALID_OWNERS = ["a", "0", "acme", "acme-labs", "a-b-c", "x" * 39, "9lives", "a1"]
INVALID_OWNERS = [
    "",
    "Root",  # uppercase is not a spelling of root
    "ROOT",
    "Acme",
    "r\u043e\u043et",  # Cyrillic о
    "\uff52\uff4f\uff4f\uff54",  # fullwidth ｒｏｏｔ
    "acme\n",  # "$" would match before the newline; fullmatch does not
    "\nacme",
    "acme ",
    " acme",
    "-acme",
    "acme-",
    "x" * 40,
    "ac_me",
    "ac.me",
    "acme/repo",
    "ac\u00e9me",
    "acme\x00",
    "ａcme",
    "\u0430cme",  # Cyrillic а
    "acme\u200b",  # zero-width space
    "ac\u212ame",  # Kelvin sign K
]

VALID_REPOS = ["a", "models", "flux2-klein-4b", "a.b", "a_b", "a..b", "1", "m" * 100, "v1.2.3"]
INVALID_REPOS = [
    "",
    ".",
    "..",
    ".hidden",
    "-x",
    "_x",
    "Models",
    "m" * 101,
    "a/b",
    "models\n",
    "mod els",
    "m\u043edels",  # Cyrillic о
    "mo\u0131dels",  # dotless ı
    "mod*",
    "mod?",
    "mod[a]",
]


@pytest.mark.parametrize("name", VALID_OWNERS)
def test_valid_owners_are_returned_unchanged(name: str) -> None:
    assert validate_owner(name) == name


@pytest.mark.parametrize("name", INVALID_OWNERS)
def test_invalid_owners_are_rejected(name: str) -> None:
    with pytest.raises(NameInvalid):
        validate_owner(name)


@pytest.mark.parametrize("name", VALID_REPOS)
def test_valid_repos_are_returned_unchanged(name: str) -> None:
    assert validate_repo(name) == name


@pytest.mark.parametrize("name", INVALID_REPOS)
def test_invalid_repos_are_rejected(name: str) -> None:
    with pytest.raises(NameInvalid):
        validate_repo(name)


@pytest.mark.parametrize("value", [None, 1, b"acme", ["acme"]])
def test_non_strings_are_rejected(value: object) -> None:
    with pytest.raises(NameInvalid):
        validate_owner(value)
    with pytest.raises(NameInvalid):
        validate_repo(value)


def test_rejection_message_escapes_the_name() -> None:
    with pytest.raises(NameInvalid) as info:
        validate_owner("r\u043e\u043et\n")
    assert "\\u043e" in info.value.message and "\\n" in info.value.message
    assert info.value.code == "NAME_INVALID" and info.value.status == 400


def test_reserved_owners() -> None:
    assert ROOT_OWNER == "root"
    assert RESERVED_OWNERS == {"root", "admin", "platform", "system", "api"}
    assert all(validate_owner(name) == name for name in RESERVED_OWNERS)  # valid, but reserved
    assert is_reserved_owner("root") and not is_reserved_owner("acme")
    assert not is_reserved_owner("Root")  # invalid anyway, and not silently folded into root


def test_split_repo_path() -> None:
    assert split_repo_path("acme/models") == ("acme", "models")
    for bad in ["acme", "acme/", "/models", "acme/models/x", "Acme/models", "acme/..", "acme//m", 3]:
        with pytest.raises(NameInvalid):
            split_repo_path(bad)


OWNER_SPEC = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,37}[a-z0-9])?")
REPO_SPEC = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
ASCII_LOWER = "abcdefghijklmnopqrstuvwxyz0123456789"


@given(st.text(alphabet=ASCII_LOWER + "-_.\n AZ\u043e\uff41", max_size=45) | st.text(max_size=45))
def test_owner_validation_agrees_with_the_ascii_grammar(text: str) -> None:
    expected = text.isascii() and OWNER_SPEC.fullmatch(text) is not None
    try:
        validate_owner(text)
        accepted = True
    except NameInvalid:
        accepted = False
    assert accepted == expected
    if accepted:
        assert set(text) <= set(ASCII_LOWER + "-") and 1 <= len(text) <= 39


@given(st.text(alphabet=ASCII_LOWER + "-._/\n ABCZ\u043e\uff41", max_size=110))
def test_repo_validation_agrees_with_the_ascii_grammar(text: str) -> None:
    expected = REPO_SPEC.fullmatch(text) is not None and text.isascii()
    try:
        validate_repo(text)
        accepted = True
    except NameInvalid:
        accepted = False
    assert accepted == expected
    if accepted:
        assert set(text) <= set(ASCII_LOWER + "-._") and 1 <= len(text) <= 100
