"""``python -m distcomm_attention.demo``: collectives, ring attention and distributed training, checked end to end."""
