"""Helpers shared by tests/ and benchmarks/ (not part of the installed package):
``tiny_models`` builds the tiny target/draft fixtures, ``server`` runs a real
`dynamo-spec serve` process for a test or a benchmark, ``engine`` generates in a fresh
in-process engine."""
