"""zeroplan: plan DeepSpeed ZeRO memory and communication before booking GPUs.

The planning API is torch-free; ``zeroplan.runtime`` and ``zeroplan.bench`` need the
``bench`` extra (torch).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
