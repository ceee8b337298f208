"""zeroplan.core."""
