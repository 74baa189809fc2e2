"""Beyond one device: tensor parallelism on torch.distributed (parallel.py: ranks, channels and
collectives; shard.py: which part of each weight a rank holds; ranks.py: rank 0 starting the
others and each other rank's loop)."""
