"""Tensor and expert parallelism on torch.distributed: the groups (parallel_state.py) and the collectives the
model calls (communication_op.py)."""
