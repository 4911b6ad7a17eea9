"""Captures: names, write, read, framework rebuilds (HF, Lightning, PEFT), inspect."""
