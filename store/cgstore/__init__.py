"""cgstore: the registry for PyTorch compiled graphs.

The server is sliced by feature (``blobs/``, ``tokens/``, ``compiled_graphs/``, ...);
inside each feature ``router.py`` (thin HTTP) calls its service (``service.py``,
or one module per verb where one file would not read well: ``compiled_graphs/``),
the capability without HTTP, which calls ``models.py`` (tables) and ``storage/``.
Shared infrastructure lives in ``core/``.
"""

__version__ = "0.1.0"
