"""Guard: detection flags, skip policy, the capture writer, rollback."""
