"""zeroplan.advice."""
