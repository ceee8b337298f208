"""Inspect the live system and its logs: local GPUs (``detect``) and NCCL debug logs (``nccl_log``).

Nothing here imports torch; ``detect`` imports ``pynvml`` only when it runs.
"""

__all__: list[str] = []
