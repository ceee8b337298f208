"""zeroplan.report."""
