"""Deterministic discrete-event simulator: replays a Mooncake-format trace through the
router's own policy, queue, bucket and prefix-index classes against simulated workers."""
