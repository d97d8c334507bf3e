"""The periodic audit checkpoint: sign the chain head under the key ring, one replica at a time.

The chain and the checkpoint itself are the audit feature's (``audit/chain.py``); running it
periodically with the store's context is an operation, like the reaper, GC and scrub, so the
context never needs a feature that needs the context back.
"""

from __future__ import annotations

from cgstore.audit import chain
from cgstore.context import StoreContext
from cgstore.operations.leases import HeldLease


def checkpoint_round(ctx: StoreContext, lease: HeldLease) -> int:
    """The periodic task: 1 when it signed a new checkpoint, else 0."""
    with ctx.db.session() as session:
        return int(chain.checkpoint(session, ctx.tokens.ring, issuer=ctx.settings.token_issuer) is not None)
