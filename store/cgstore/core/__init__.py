"""Shared infrastructure: database session and Base, the error hierarchy, auth."""
