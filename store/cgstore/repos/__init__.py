"""Repositories: ``owner/repo`` namespaces, their visibility, and who may read or write them."""
