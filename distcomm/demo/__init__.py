"""``python -m distcomm.demo``: collectives, ring attention and distributed training, checked end to end."""
