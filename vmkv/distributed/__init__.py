"""Scale-out on torch.distributed: tensor-parallel ranks (sharding, collectives, the workers,
rank 0's executor, and rank 0's KV changes applied by every other rank to keep its KV manager
in step)."""
