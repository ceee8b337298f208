"""zeroplan.specs: the inputs as typed data (see zeroplan/ARCHITECTURE.md).

Every pydantic model here is declared with ``defer_build=True``: its validator and serializer are
built on first use, not at import, so a process pays only for the specs it uses (an estimate from a
catalog name never validates a ``DSConfig``, a ``HardwareProfile`` or a ``TrainingFile``).
(tests/bench/bench_startup.py measures the cold start.) The core's result models stay eager: each
is used by every plan, and deferring them only moved the same work from the import to the first
``estimate()`` (measured: no gain).
"""
