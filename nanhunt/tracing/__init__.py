"""trace(), Trace: op and module recording, phases, the records store, locate, the dataflow graph, stats."""
