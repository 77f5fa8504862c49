"""Example training scripts; each runs with torchrun (see its docstring) and is tested on CPU with gloo."""
