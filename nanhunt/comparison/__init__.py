"""compare(): float32 reference vs autocast on a fixed set: record, measure, decide, rule, speed, history."""
