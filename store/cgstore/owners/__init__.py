"""Principals (platform or tenant) and the owner slugs they hold."""
