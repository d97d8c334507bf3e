"""``in_values``: one constant statement for any number of values, matching exactly the values given."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select

from cgstore.core.db import Database, in_values

_metadata = MetaData()
_things = Table("in_values_things", _metadata, Column("id", Integer, primary_key=True), Column("name", String(64)))
# Strings a hand-built array literal could get wrong: quotes, backslashes, commas, braces, spaces, NULL.
_NAMES = ["plain", 'with "quotes"', "back\\slash", "a,b", "{braces}", " spaced ", "NULL", "", "ck1-" + "0" * 56]


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'in_values.sqlite3'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    database = Database(url)
    _metadata.create_all(database.engine)
    with database.session() as session:
        session.execute(_things.delete())
        session.execute(insert(_things), [{"id": i + 1, "name": name} for i, name in enumerate(_NAMES)])
    yield database
    _metadata.drop_all(database.engine)
    database.dispose()


def test_strings_and_ints_match_exactly_the_values_given(db):
    cases = [(_NAMES[1:4], _NAMES[1:4]), (_NAMES, _NAMES), (["absent", "NULL"], ["NULL"]), ([""], [""])]
    with db.session() as session:
        for wanted, expected in cases:
            found = session.scalars(select(_things.c.name).where(in_values(session, _things.c.name, wanted)))
            assert sorted(found) == sorted(expected)
        ids = session.scalars(select(_things.c.id).where(in_values(session, _things.c.id, [2, 5, 99]))).all()
        assert sorted(ids) == [2, 5]
        assert session.scalars(select(_things.c.id).where(in_values(session, _things.c.id, []))).all() == []
