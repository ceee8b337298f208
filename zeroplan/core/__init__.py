"""The analytic core: torch-free maths over the specs (memory, activations, comm, time, plan)."""
