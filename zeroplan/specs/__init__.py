"""zeroplan.specs."""
