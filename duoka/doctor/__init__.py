"""`duoka doctor`: check a machine for multi-GPU training, and explain a failed run's log."""
