"""zeroplan: plan DeepSpeed ZeRO memory and communication before booking GPUs.

The planning API is torch-free; ``zeroplan.runtime`` and ``zeroplan.bench`` need the
``bench`` extra (torch).
"""

from zeroplan._version import __version__
__all__ = ["__version__"]
