"""zeroplan.runtime."""
