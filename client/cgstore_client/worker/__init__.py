"""The worker side of the client: what a serving worker runs at boot.

Resolve or discover, verified download into the shared cache, binding constants, serving
(``client``, ``http``, ``download``, ``cache``, ``discovery``, ``loader``, ``outcomes``) and the
``cgstore-client`` CLI. It builds on the contract beside it (``keys``, ``binding``, ``archive``,
``components``, ``metadata``, ``lanes``, ``receipts``, ``wire``, ``environment``, ``mint``),
which never imports anything from here (``tests/house/test_layers.py``).
"""
