"""The declaration every fleet test boots: the tiny model of ``tests/support/archives.py``, its dynamic batch.

Exported this way the tiny model's graph is archive A's (``pt2_archive``): a test can publish the
session's archive as "someone else's mint" of the very graph the workers run.
"""

from __future__ import annotations

from cgstore_client.keys import Envelope
from tests.support.archives import BATCH_MAX, BATCH_MIN

ENVELOPE = Envelope(shapes=[(64, 64)], text_len=0, batch_sizes=[1, 2, 5])


def dynamic_shapes():
    import torch

    batch = torch.export.Dim("batch", min=BATCH_MIN, max=BATCH_MAX)
    return ({"x": {0: batch}, "y": {0: batch}}, None)
