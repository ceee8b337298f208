"""zeroplan.bench."""
