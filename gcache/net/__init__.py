"""Networking shared by every layer that moves bytes: addresses, the Stream seam, exact reads and
scatter-gather writes. Nothing here knows the gcache protocol."""
