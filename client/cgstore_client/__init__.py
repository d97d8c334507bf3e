"""cgstore client: the contract every worker and the store share.

``keys`` (ck1 derivation), ``archive`` (static .pt2 reader), ``metadata``
(compiled-graph metadata schema), ``lanes`` (kernel-lane rules) need no
network and no torch; ``mint`` (packaging a compiled graph) needs the
``torch`` extra.
"""

__version__ = "0.1.0"
