"""zeroplan.specs: the inputs as typed data (see zeroplan/ARCHITECTURE.md).

Every pydantic model here is declared with ``defer_build=True``: its validator and serializer are
built on first use, not at import, so a process pays only for the specs it uses (an estimate from a
catalog name never validates a ``DSConfig``, a ``HardwareProfile`` or a ``TrainingFile``).
Measured on ``import zeroplan; zeroplan.estimate(model="llama-2-70b", gpus=64)``: 1,168 M → 1,136 M
instructions (valgrind cachegrind). The core's result models stay eager: each is used on every
plan, and a deferred model nested in another is rebuilt inside each parent's schema (deferring
them measured no gain).
"""
