"""``gcache-router bench``: the router's own overhead, measured against the same echo worker."""
