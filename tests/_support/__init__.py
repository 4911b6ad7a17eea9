"""What the tests share: fixture models, training loops, golden files, process and rank launchers.

Imported as ``from tests._support.x import ...`` by the tests and by the workers they start (which run with
the repository root on their path); names a capture or the command line gives are ``tests._support.x:Name``."""
