"""Step: the replayable step, the snapshot engine, float32 regions (keep_fp32)."""
