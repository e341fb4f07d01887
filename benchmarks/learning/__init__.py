"""Application traffic for ``benchmarks.learning_cycle`` (``traffic.py`` writes and reads it)."""
