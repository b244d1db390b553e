"""Runtime: the DDP comm hook and what it consults each step (health monitor, capacity gate,
traffic meter, fault injection)."""
