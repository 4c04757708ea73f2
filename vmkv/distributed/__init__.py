"""Scale-out on torch.distributed: tensor-parallel ranks (sharding, collectives, the workers,
rank 0's executor and the KV replay that keeps every rank's KV manager in step)."""
