"""What the adapters say when an owner fails inside a batch (``ClientConfig.on_failure``).

Both run their client with ``OnNodeError.MISS``: a failed owner's keys come back as misses,
which keeps SGLang going, but a wrong token or a dead daemon would then be silent for ever.
One line a minute per kind, pointing at the fix where there is one.
"""

from __future__ import annotations

from gcache.errors import GCacheError, ServerError
from gcache.protocol import ErrorCode
from gcache.ratelog import RateLimitedLog


def report_owner_failure(limited: RateLimitedLog, exc: GCacheError, who: str, what: str, token_hint: str) -> None:
    """``who``: the adapter's log prefix; ``what``: what the owner's keys are ("pages", ...);
    ``token_hint``: where this adapter takes its token from."""
    if isinstance(exc, ServerError) and exc.code == ErrorCode.AUTH:
        limited.error("auth", "%s: %s: every %s it owns is a miss; give the cluster token with %s or "
                      "$GCACHE_TOKEN_FILE", who, exc, what.rstrip("s"), token_hint)
    else:
        limited.warning("owner", "%s: %s: the %s it owns were answered as misses", who, exc, what)
