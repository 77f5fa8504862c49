"""The compiled path: what the public functions run under ``torch.compile``, in one place.

    path.py   the public functions' compiled implementations: validated arguments in, custom ops called
              (forms the ops do not cover rewritten with them; shape-learning forms run eagerly)
    ops.py    the collectives as ``torch.library`` custom ops, with fake and autograd implementations
              (Note [Compiled collectives])

Both import the eager modules at their top; no eager module imports this package. The public functions
reach it through :func:`distcomm._dispatch.compiled_path` when they are first compiled (Note [Import
direction of the compiled path] there): importing it loads ``torch._dynamo``, which ``import distcomm``
must not pay for. This ``__init__`` imports nothing, so ``distcomm._compile.ops`` alone registers the ops.
"""

__all__: list[str] = []
