"""``python -m distcomm.demo``: the collectives and a distributed CLIP model, checked end to end.

``python -m distcomm_attention.demo`` runs these parts too, plus ring attention and a ring-attention language
model (the attention package builds on this one, never the other way round).
"""
