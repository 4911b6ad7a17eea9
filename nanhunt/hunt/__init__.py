"""The pipeline: trace twice -> bisect -> repro -> advice -> Report; the torchrun replay and its choice of rank."""
