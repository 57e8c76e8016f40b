"""Trajectories to training batches and new weights back to the served model (see DESIGN.md)."""
