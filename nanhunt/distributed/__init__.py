"""Distributed checkpoints (DCP) and FSDP1: used by capture and guard."""
