"""The one input rule for request text: what may reach the database, checked before any query.

Every JSON body (``core.http.read_json``) and every query value (the app-wide
``refuse_unstorable_parameters`` dependency) passes ``check_text``.
Two kinds of character are refused with 400 ``BAD_REQUEST``:

- NUL (``\\x00``): PostgreSQL cannot store it in ``text`` or ``jsonb`` and fails
  the query, so the same request would be a 500 there and fine on SQLite;
- lone surrogates (``"\\ud800"`` in a JSON string): not Unicode scalar values,
  so no UTF-8 answer can ever carry them back to a reader.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request

from cgstore.core.errors import BadRequest

#: Characters no stored text may hold (see the module docstring).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: How much of a client-chosen parameter name an error message repeats.
_NAME_CHARS = 64


def check_text(value: Any, where: str) -> None:
    """Refuse ``value`` (a string, or a parsed JSON document: keys included) if any text in it is unstorable."""
    if isinstance(value, str):
        if _UNSTORABLE.search(value) is not None:
            raise BadRequest(f"{where} holds a NUL or a lone surrogate", where=where)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, where)
            check_text(item, where)
    elif isinstance(value, list):
        for item in value:
            check_text(item, where)


async def refuse_unstorable_parameters(request: Request) -> None:
    """App-wide dependency: query names and values obey ``check_text`` before any route runs.

    Path values are left to each route's grammar (names, digests, keys, ids): a
    refused one must still answer as the route does (a 401/403 first, audited).
    """
    for name, value in request.query_params.multi_items():
        check_text(name, "query")
        check_text(value, f"query parameter {name[:_NAME_CHARS]!r}")
