"""Compiled-graph records: admission on publish, write-once keys, named CAS components, batch resolve."""
