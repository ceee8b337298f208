"""CLI command modules. Each module defines ``register(app)`` and keeps heavy imports
(torch, pynvml) inside the command functions so planning commands start fast."""
